"""Precise prefix routing (the engines' KV events) against approximate, load-only and round-robin, on a
workload shaped like llm-d's precise-scheduling benchmark: groups of users, each group sharing a long
prefix of its own, the groups' prefixes together filling more than 70% of the pool's KV cache.

1. Simulation (routing_sim.py) at `--sim-pods` pods, one gateway replica and `--sim-gateways` replicas
   (independent replicas behind one Service: each knows only its own dispatches, but all receive every
   engine's events), plus a workload whose prompts share nothing (no loss allowed there).
2. Real engines: three `kubeinfer serve` processes with small KV caches and `--kv-events-config`, behind
   the gateway in proxy mode (`--prefix-routing precise`, the engines' tokenizer by `--tokenizer`), the
   same schedule for each policy; TTFT measured at the client, prefix hits from the engines' counters.
Results go to the `precise-routing` section of benchmarks/RESULTS.md.

    python benchmarks/bench_precise_routing.py [--sim-pods 100] [--real-requests 120] [--skip-real]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from bench_routing import (  # noqa: E402
    CACHE,
    EngineProcesses,
    MAX_NUM_SEQS,
    VOCAB,
    Outcome,
    RealRun,
    free_port,
)
from results import update_results  # noqa: E402
from routing_sim import Workload, simulate  # noqa: E402

from kubeinfer.gateway.app import Gateway, GatewayConfig  # noqa: E402
from kubeinfer.gateway.scheduling.picker import DEFAULT_WEIGHTS, PickerConfig  # noqa: E402
from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402

POLICIES = ("precise", "approximate", "load-only", "round-robin")
LOAD_ONLY = {**DEFAULT_WEIGHTS, "prefix": 0.0, "affinity": 0.0}


def picker_for(policy: str) -> tuple[str, PickerConfig]:
    """(the gateway's --prefix-routing, its picker config) for a policy of this benchmark."""
    if policy == "round-robin":
        return "approximate", PickerConfig(policy="round-robin")
    if policy == "load-only":
        return "approximate", PickerConfig(weights=dict(LOAD_ONLY))
    return policy, PickerConfig()


# -- part 1: the simulation ---------------------------------------------------------------------------------
def llm_d_workload(pods: int, requests_per_pod: int, rate_per_pod: float, seed: int, shared: bool = True) -> Workload:
    """6000-token group prefixes, as many groups as fill 72% of the pool's KV cache (6250 blocks of 16 a pod):
    each group's prefix is 375 blocks, so 12 groups a pod. Without `shared`, every prompt is its own: a
    system prompt shorter than a block (nothing to share) and a question of 2000-4000 tokens."""
    groups = round(0.72 * pods * 6250 / 375)
    return Workload(requests=requests_per_pod * pods, rate=rate_per_pod * pods, burst_mean=2.0,
                    base_system_prompts=groups if shared else 1, adapters=0,
                    system_tokens=(6000, 6000) if shared else (1, 15),
                    question_tokens=(100, 400) if shared else (2000, 4000), output_tokens=(50, 300), zipf=0.0,
                    seed=seed)


def sim_part(args) -> tuple[str, list[dict]]:
    rows, table = [], ["| workload | gateways | policy | TTFT p50 (s) | TTFT p90 (s) | throughput (tok/s) | prefix hits |",
                       "|---|---|---|---|---|---|---|"]
    cases = [("shared prefixes", True, 1), ("shared prefixes", True, args.sim_gateways), ("nothing shared", False, 1)]
    cases = [case for i, case in enumerate(cases) if str(i + 1) in args.sim_cases]
    for label, shared, gateways in cases:
        workload = (llm_d_workload(args.sim_pods, args.sim_requests_per_pod, args.sim_rate_per_pod, args.seed) if shared
                    else llm_d_workload(args.sim_pods, 100, args.sim_unshared_rate_per_pod, args.seed, shared=False))
        for policy in args.sim_policies.split(","):
            routing, config = picker_for(policy)
            started = time.time()
            result = simulate(args.sim_pods, workload, config.policy, picker_config=config, report_ends=True,
                              gateways=gateways, precise=routing == "precise")
            row = {"workload": label, "gateways": gateways, "policy": policy, "ttft_p50": result.ttft(50),
                   "ttft_p90": result.ttft(90), "throughput": result.throughput, "hit_rate": result.prefix_hit_rate}
            rows.append(row)
            table.append(f"| {label} | {gateways} | {policy} | {row['ttft_p50']:.3f} | {row['ttft_p90']:.3f} | "
                         f"{row['throughput']:.0f} | {row['hit_rate']:.1%} |")
            print(table[-1], f"({time.time() - started:.0f} s)", flush=True)
    return "\n".join(table), rows


# -- part 2: real engines -----------------------------------------------------------------------------------
MODEL_DIR = CACHE / "bench-precise-model"
MODEL_SHAPE = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768,
                   max_position_embeddings=2048)
KV_BLOCKS, BLOCK_SIZE = 160, 16  # per engine: 2560 tokens, three groups' prefixes and a little more
GROUPS, PREFIX_TOKENS = 9, 512  # 9 x 32 blocks: 60% of the pool's 480 in prefixes, over 70% with the requests' own
QUESTION_TOKENS, OUTPUT_TOKENS = (96, 192), (8, 16)


class Engines(EngineProcesses):
    """Three engines with KV events on, each on its own ports."""

    startup_seconds = 240

    def __init__(self, count: int = 3) -> None:
        if not (MODEL_DIR / "config.json").exists():
            build_random_model(MODEL_DIR, "llama", initializer_range=0.02, **MODEL_SHAPE)
        ports = [free_port() for _ in range(count)]
        self.urls = [f"http://127.0.0.1:{p}" for p in ports]
        self.logs = [CACHE / f"bench-precise-engine-{i}.log" for i in range(count)]
        # A wildcard is bound (a plain address would be connected to, vLLM's convention); the engine's /load
        # names the ports it got.
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                  "replay_endpoint": "tcp://127.0.0.1:*"}
        self.commands = [[sys.executable, "-m", "kubeinfer.cli", "serve", str(MODEL_DIR), "--host", "127.0.0.1",
                          "--port", str(port), "--served-model-name", "base", "--max-num-seqs", str(MAX_NUM_SEQS),
                          "--num-kv-blocks", str(KV_BLOCKS), "--block-size", str(BLOCK_SIZE),
                          "--max-model-len", "2048", "--kv-events-config", json.dumps(events), "--log-level", "warning"]
                         for port in ports]


def real_jobs(count: int, rate: float, seed: int, shared: bool) -> list[tuple[float, list[int], int]]:
    """(arrival, prompt token ids, max_tokens): users of GROUPS groups, each group's prompts opening with its
    own prefix; or (not `shared`) every prompt its own."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(*VOCAB) for _ in range(PREFIX_TOKENS)] for _ in range(GROUPS)]
    jobs, now = [], 0.0
    for i in range(count):
        now += rng.expovariate(rate)
        head = prefixes[rng.randrange(GROUPS)] if shared else [rng.randrange(*VOCAB) for _ in range(PREFIX_TOKENS)]
        question = [rng.randrange(*VOCAB) for _ in range(rng.randint(*QUESTION_TOKENS))]
        jobs.append((now, head + question, rng.randint(*OUTPUT_TOKENS)))
    return jobs


async def one_request(client, url: str, prompt: list[int], max_tokens: int, salt: int, started: float) -> Outcome:
    body = {"model": "base", "prompt": [salt, *prompt], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    sent, first, tokens, replica = time.perf_counter(), None, 0, ""
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"gateway answered {response.status_code}: {(await response.aread())[:300]!r}")
        replica = response.headers.get("x-gateway-destination-endpoint", "")
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                payload = json.loads(line[6:])
                if payload.get("choices") and payload["choices"][0].get("token_ids"):
                    first = first or time.perf_counter()
                    tokens += len(payload["choices"][0]["token_ids"])
    return Outcome((first or time.perf_counter()) - sent, time.perf_counter() - started, tokens, replica)


def synced(gateway, engines: int) -> bool:
    """The gateway follows every engine and has applied a stored block (it knows the block size)."""
    index = gateway.kv_index
    with index.lock:
        return len(index.pods) == engines and bool(index.block_sizes)


async def run_real(engines: Engines, policy: str, jobs, salt: int) -> RealRun:
    routing, config = picker_for(policy)
    gateway = Gateway(GatewayConfig(host="127.0.0.1", port=0, ext_proc_port=None, metrics_port=None,
                                    endpoints=engines.urls, picker=config, prefix_routing=routing,
                                    tokenizers=[str(MODEL_DIR)], kv_events_port=0))
    await gateway.start()
    if gateway.kv_subscriber is not None:  # every engine's events followed before the first request:
        deadline, rng = time.monotonic() + 60, random.Random(salt)  # a small request makes each publish; the
        while not synced(gateway, len(engines.urls)) and time.monotonic() < deadline:  # first batch
            async with httpx.AsyncClient(timeout=60) as client:  # received brings the rest by replay
                await asyncio.gather(*(client.post(u + "/v1/completions", json={
                    "model": "base", "prompt": [rng.randrange(*VOCAB) for _ in range(40)], "max_tokens": 1})
                    for u in engines.urls))
            await asyncio.sleep(0.3)
        if not synced(gateway, len(engines.urls)):
            await gateway.stop()
            raise SystemExit("the gateway received no KV events from the engines: see their logs in .cache/")
    url = f"http://127.0.0.1:{gateway.ports['proxy']}"
    q0, h0 = await asyncio.to_thread(engines.prefix_counters)
    started = time.perf_counter()
    try:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=len(jobs))) as client:
            async def timed(job):
                await asyncio.sleep(max(0.0, job[0] - (time.perf_counter() - started)))
                return await one_request(client, url, job[1], job[2], salt, started)
            outcomes = await asyncio.gather(*(timed(j) for j in jobs))
    finally:
        await gateway.stop()
    q1, h1 = await asyncio.to_thread(engines.prefix_counters)
    return RealRun(policy, outcomes, max(o.finished for o in outcomes), q1 - q0, h1 - h0)


def real_part(args) -> tuple[str, list[dict]]:
    rows, table = [], ["| workload | policy | TTFT p50 (s) | TTFT p90 (s) | throughput (tok/s) | prefix hits | per engine |",
                       "|---|---|---|---|---|---|---|"]
    with Engines() as engines:
        for label, shared in (("shared prefixes", True), ("nothing shared", False)):
            jobs = real_jobs(args.real_requests, args.real_rate, args.seed, shared)
            # each run opens its prompts with a token of its own: none finds another run's prefixes cached
            for salt, policy in enumerate(POLICIES, start=1 + (0 if shared else 10)):
                run = asyncio.run(run_real(engines, policy, jobs, salt))
                row = {"workload": label, "policy": policy, "ttft_p50": run.ttft(50), "ttft_p90": run.ttft(90),
                       "throughput": run.throughput, "hit_rate": run.hit_rate}
                rows.append(row)
                table.append(f"| {label} | {policy} | {row['ttft_p50']:.2f} | {row['ttft_p90']:.2f} | "
                             f"{row['throughput']:.1f} | {row['hit_rate']:.1%} | {run.per_replica(engines.urls)} |")
                print(table[-1], flush=True)
    return "\n".join(table), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sim-pods", type=int, default=100)
    parser.add_argument("--sim-gateways", type=int, default=4)
    parser.add_argument("--sim-requests-per-pod", type=int, default=400)
    parser.add_argument("--sim-rate-per-pod", type=float, default=8.75)
    parser.add_argument("--real-requests", type=int, default=120)
    parser.add_argument("--real-rate", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sim-unshared-rate-per-pod", type=float, default=4.0,
                        help="the nothing-shared case's rate (100 requests a pod): every prompt is a full prefill")
    parser.add_argument("--sim-policies", default=",".join(POLICIES))
    parser.add_argument("--sim-cases", default="123", help="which simulated cases: 1 shared prefixes, 2 the same "
                        "with --sim-gateways replicas, 3 nothing shared")
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--skip-sim", action="store_true")
    args = parser.parse_args()
    machine = f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared), Python {platform.python_version()}."
    command = "Command: `" + ("python benchmarks/bench_precise_routing.py " + " ".join(sys.argv[1:])).strip() + "`. "
    if not args.skip_sim:
        table, _ = sim_part(args)
        update_results("precise-routing-sim", "Precise prefix routing (KV events), simulated", command + machine + (
            f" {args.sim_pods} pods (routing_sim.py's pod model: 6250 KV blocks of 16), {args.sim_requests_per_pod} "
            f"requests a pod at {args.sim_rate_per_pod}/s a pod; groups' 6000-token prefixes fill 72% of the pool's "
            f"KV cache (llm-d's run: 73%); KV events reach the gateways 50 ms after the change.\n\n{table}"))
    if not args.skip_real:
        table, _ = real_part(args)
        update_results("precise-routing-real", "Precise prefix routing (KV events), real engines", command + machine + (
            f" Three `kubeinfer serve` processes ({KV_BLOCKS} KV blocks of {BLOCK_SIZE} each, one torch thread), "
            f"the gateway in proxy mode, {args.real_requests} requests at {args.real_rate}/s; {GROUPS} groups "
            f"sharing {PREFIX_TOKENS}-token prefixes.\n\n{table}"))

if __name__ == "__main__":
    main()
