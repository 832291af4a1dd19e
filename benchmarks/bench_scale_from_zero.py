"""Scale from zero: the first request's time to first token when its model has no active engine, answered
by promoting a warm standby against starting an engine cold, through the real gateway.

Each trial starts the gateway (proxy mode) with no engine for the model, so the request is held
(kubeinfer/gateway/flowcontrol/hold.py) and the gateway asks for capacity once, as it asks an InferenceModel's
/scale in a cluster. What answers the ask stands in for the operator:
  * warm standby: an engine already running with the model loaded, but not routed (a standby pod);
    the ask adds its address to the gateway's pool, as the promotion's relabel does through discovery;
  * cold: the ask starts `kubeinfer serve` (what a new pod runs once scheduled: load the model and
    warm up), and adds its address at once; the gateway polls it until it is ready.
The floor is the same request to an engine that is already routed.

Left out, and to add for a cluster: the operator's reaction to /scale and the watch event that tells
the gateway (0.08-0.09 s for a standby promotion, measured against a real kube-apiserver), and for a
cold pod its scheduling, image pull and GPU initialisation.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_routing import BASE, free_port  # noqa: E402
from results import update_results  # noqa: E402
from scale_sim import WakeScenario, simulate_wake  # noqa: E402

from kubeinfer.gateway.app import Gateway, GatewayConfig  # noqa: E402
from kubeinfer.gateway.datastore.discovery import static_endpoints  # noqa: E402
from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402

CACHE = Path(__file__).resolve().parents[1] / ".cache"
DEMO_DIR = CACHE / "demo-model"  # what `kubeinfer local-stack` serves (built, about two minutes, if missing)
LARGER_DIR = CACHE / "bench-scale-from-zero-model"
# --larger: the throughput benchmark's shape (8 layers, hidden 512), random weights.
LARGER_SHAPE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536,
                    max_position_embeddings=1024, initializer_range=0.02)
MODEL_DIR = DEMO_DIR


def prepare_model(larger: bool) -> str:
    """Builds the model if missing; returns how to describe it."""
    global MODEL_DIR
    if larger:
        MODEL_DIR = LARGER_DIR
        if not (MODEL_DIR / "config.json").exists():
            build_random_model(MODEL_DIR, "llama", **LARGER_SHAPE)
        return "a random-init Llama of the throughput benchmark's shape (8 layers, hidden 512)"
    from kubeinfer.dev.demo_model import build_demo_model

    MODEL_DIR = build_demo_model(DEMO_DIR) / "base"  # the base model; its adapters are not needed here
    return "the local stack's demo model (`kubeinfer demo-model`)"


def engine_command(port: int) -> list[str]:
    return [sys.executable, "-m", "kubeinfer.cli", "serve", str(MODEL_DIR), "--host", "127.0.0.1", "--port",
            str(port), "--served-model-name", BASE, "--max-model-len", "1024", "--log-level", "warning"]


def start_engine(port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(engine_command(port), stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


async def wait_ready(url: str, process: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"engine {url} exited with {process.returncode}")
            try:
                if (await http.get(url + "/health", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit(f"engine {url} was not ready within {timeout:.0f} s")


async def first_token(proxy_url: str) -> float:
    """Seconds from sending a streamed completion to its first token."""
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as http:
        async with http.stream("POST", proxy_url + "/v1/completions", json={
                "model": BASE, "prompt": "The first request after a quiet night", "max_tokens": 8,
                "stream": True}) as response:
            if response.status_code != 200:
                raise SystemExit(f"the gateway answered {response.status_code}: {await response.aread()}")
            async for line in response.aiter_lines():
                if line.startswith("data: ") and '"text"' in line:
                    return time.perf_counter() - started
    raise SystemExit("the stream ended without a token")


async def trial(mode: str, standby: tuple[str, subprocess.Popen] | None) -> float:
    """TTFT of one request through a fresh gateway; `mode`: routed, standby or cold."""
    placeholder = "http://127.0.0.1:9"  # the gateway needs a member to start in static mode; never ready
    routed = [standby[0]] if mode == "routed" else [placeholder]
    gateway = Gateway(GatewayConfig(host="127.0.0.1", port=0, ext_proc_port=None, metrics_port=None,
                                    endpoints=routed, scrape_interval=0.25))
    cold: subprocess.Popen | None = None

    async def ask(model: str, held: int) -> bool:
        nonlocal cold
        if gateway.pool.endpoints:
            return False  # one request, one pod: already on its way
        if mode == "standby":
            url = standby[0]
        else:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cold = start_engine(port, CACHE / "bench-scale-from-zero-cold.log")
        gateway.pool.set_members(static_endpoints([url]))
        return True

    await gateway.start()
    gateway.router.scalable = {BASE}  # an InferenceModel serves it: hold, do not 404
    gateway.router.hold.ask = ask
    if mode != "routed":
        gateway.pool.set_members([])  # scaled to zero: no engine for the model
    try:
        return await first_token(f"http://127.0.0.1:{gateway.ports['proxy']}")
    finally:
        await gateway.stop()
        if cold is not None:
            cold.terminate()
            cold.wait(timeout=60)


async def run(trials: int) -> dict[str, list[float]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_engine(port, CACHE / "bench-scale-from-zero-standby.log")
    try:
        await wait_ready(url, process)
        await first_token_direct(url)  # the standby's own warm-up has run: it is what a standby pod is
        times: dict[str, list[float]] = {"routed": [], "standby": [], "cold": []}
        for i in range(trials):
            for mode in ("routed", "standby", "cold"):
                times[mode].append(await trial(mode, (url, process)))
                print(f"trial {i + 1}, {mode}: {times[mode][-1]:.3f} s", flush=True)
        return times
    finally:
        process.terminate()
        process.wait(timeout=60)


async def first_token_direct(url: str) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        response = await http.post(url + "/v1/completions", json={"model": BASE, "prompt": "warm", "max_tokens": 2})
        response.raise_for_status()


WAKE_RUNS = (  # name, standby pods, scale to zero, ask sized by the held requests, fair queue at the gateway
    ("always on (minReplicas 100)", 0, False, True, False),
    ("to zero, no standby, ask for 1 (before)", 0, True, False, False),
    ("to zero, no standby, sized ask", 0, True, True, False),
    ("to zero, no standby, sized ask, fair queue", 0, True, True, True),
    ("to zero, 4 warm standby, sized ask", 4, True, True, False),
    ("to zero, 4 warm standby, sized ask, fair queue", 4, True, True, True),
    ("to zero, 16 warm standby, sized ask", 16, True, True, False))


def wake_part(scenario: WakeScenario) -> str:
    """The simulated model that idles and wakes at 100 pods (scale_sim.py)."""
    runs = [simulate_wake(scenario, standby, to_zero, name=name, sized_ask=sized, fair_queue=fair)
            for name, standby, to_zero, sized, fair in WAKE_RUNS]
    on, before, sized, queued = runs[0], runs[1], runs[2], runs[3]
    rows = [f"| {r.name} | {seconds(r.first_wake_ttft)} | {seconds(r.ttft(50))} | {seconds(r.ttft(95))} | "
            f"{seconds(r.ttft(99))} | {r.max_held:,} | {r.pod_seconds / 3600:.1f} |" for r in runs]
    s = scenario
    return "\n".join([
        f"Simulated (benchmarks/scale_sim.py): one model at {s.pods} pods, {s.rate_per_pod:g} requests/s per pod "
        f"(the routing simulation's requests and pods), {s.busy_s:.0f} s busy, {s.idle_s:.0f} s without a request, "
        f"then the same traffic again at once. The operator's real `Autoscaler` every {s.resync_s:.0f} s (target "
        f"queue depth {s.target_queue_depth:g}, scaleDownDelaySeconds {s.scale_down_delay_s}); the gateway's real "
        "picker, hold and /scale ask: \"ask for 1\" is max(1, minReplicas) once (what the gateway did before), "
        "\"sized ask\" is the real `ScaleTarget.replicas_for(held)`, asked again at most every second while the "
        "hold grows; \"fair queue\": a request that finds every ready pod saturated waits at the gateway (up to "
        f"30 s). A promoted standby serves {s.promote_s:g} s after the ask, a new pod {s.cold_start_s:.0f} s "
        "(+-20%) after it is created (an 8B model on a node with the image). Pod-hours: every pod that exists "
        "(active, standby, starting) until the end of the second busy phase. TTFT: the requests of the second "
        "busy phase.",
        "", "| configuration | first request TTFT (s) | TTFT p50 (s) | TTFT p95 (s) | TTFT p99 (s) | most requests held "
            "| pod-hours |",
        "|---|---|---|---|---|---|---|", *rows, "",
        f"What it shows: going to zero without a standby saves {1 - before.pod_seconds / on.pod_seconds:.0%} of the "
        "pod-hours here, and warm standbys turn the first request's wait from a cold start "
        f"({before.first_wake_ttft:.0f} s) into a promotion ({runs[4].first_wake_ttft:.2f} s); standby pods run "
        "beside the active ones at all times (the Deployment keeps replicas + standby pods), so they cost "
        "pod-hours in the busy phases too. The wake-up is only as good as the capacity that comes back with it. "
        "Asking for one pod, every request that arrives during its cold start is held, then released onto that "
        "one pod, where thousands of prompts queue for prefill while the autoscaler (which sees only the queues "
        f"of ready pods) grows the model at its next pass: TTFT p95 {before.ttft(95):.0f} s. Sizing the ask by "
        f"the held requests brings the pods back together ({sized.ttft(95):.0f} s); the fair queue also stops the "
        f"held burst from piling onto the first pods to come up ({queued.ttft(95):.0f} s, about one cold start). "
        "Left: requests waiting in the fair queue are still invisible to the operator's autoscaler (with 4 "
        f"standbys the model had all {s.pods} pods {full_at(runs[4], s):.0f} s after the wake-up without the fair "
        f"queue, {full_at(runs[5], s):.0f} s with it)."])


def seconds(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.0f}"


def full_at(run, scenario: WakeScenario) -> float:
    """Seconds from the wake-up until the model was asked for all its pods again."""
    wake_at = run.horizon_s - scenario.busy_s
    return next(t for t, n in run.replicas_trace if t >= wake_at and n == scenario.pods) - wake_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--larger", action="store_true", help="a larger random model instead of the demo model")
    parser.add_argument("--sim-only", action="store_true", help="print only the simulated wake-up at 100 pods")
    args = parser.parse_args()
    if args.sim_only:
        print(wake_part(WakeScenario()))
        return
    model = prepare_model(args.larger)
    times = asyncio.run(run(args.trials))
    rows = [f"| {label} | {statistics.median(times[mode]):.3f} | {min(times[mode]):.3f} | {max(times[mode]):.3f} |"
            for mode, label in (("routed", "engine already routed (floor)"),
                                ("standby", "held, warm standby promoted"), ("cold", "held, engine started cold"))]
    standby, cold = statistics.median(times["standby"]), statistics.median(times["cold"])
    body = "\n".join([
        f"Command: `python benchmarks/bench_scale_from_zero.py --trials {args.trials}"
        f"{' --larger' if args.larger else ''}`. Time to first token of a "
        "streamed completion (8 tokens) sent through the gateway's proxy while its model has no routed engine: "
        "the gateway holds it and asks for capacity once; a warm standby (an engine running with the model loaded, "
        "unrouted) is promoted by adding it to the gateway's pool, or an engine is started cold (`kubeinfer serve` "
        f"loads the model and warms up). Model: {model}, CPU, one torch thread. The gateway polls a pod that "
        "joins its pool within 20 ms (then every 0.25 s), and checks held requests every 20 ms. Not included "
        "(cluster-dependent): the operator's reaction to /scale and the watch event (0.08-0.09 s for a promotion "
        "against a real kube-apiserver), and a cold pod's scheduling, image pull and GPU initialisation, which "
        "only widen the gap.",
        "", "| first request | TTFT median (s) | min (s) | max (s) |", "|---|---|---|---|", *rows, "",
        f"A warm standby answers the first request {cold / standby:.1f}x sooner than a cold start here.",
        "", "### A model that idles and wakes, at 100 pods", "", wake_part(WakeScenario())])
    print(body)
    update_results("scale-from-zero", "Scale from zero: warm standby vs cold start", body)


if __name__ == "__main__":
    main()
