"""Scale from zero: the first request's time to first token when its model has no active engine, answered
by promoting a warm standby against starting an engine cold, through the real gateway.

Each trial starts the gateway (proxy mode) with no engine for the model, so the request is held
(gateway/hold.py) and the gateway asks for capacity once, as it asks an InferenceModel's /scale in a
cluster. What answers the ask stands in for the operator:
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

from kubeinfer.gateway.app import Gateway, GatewayConfig  # noqa: E402
from kubeinfer.gateway.discovery import static_endpoints  # noqa: E402
from kubeinfer.testing.random_model import build_random_model  # noqa: E402

CACHE = Path(__file__).resolve().parents[1] / ".cache"
MODEL_DIR = CACHE / "bench-scale-from-zero-model"
# The throughput benchmark's model (8 layers, hidden 512).
MODEL_SHAPE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536,
                   max_position_embeddings=1024, initializer_range=0.02)


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

    async def ask(model: str) -> bool:
        nonlocal cold
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
    if not (MODEL_DIR / "config.json").exists():
        build_random_model(MODEL_DIR, "llama", **MODEL_SHAPE)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    times = asyncio.run(run(args.trials))
    rows = [f"| {label} | {statistics.median(times[mode]):.3f} | {min(times[mode]):.3f} | {max(times[mode]):.3f} |"
            for mode, label in (("routed", "engine already routed (floor)"),
                                ("standby", "held, warm standby promoted"), ("cold", "held, engine started cold"))]
    standby, cold = statistics.median(times["standby"]), statistics.median(times["cold"])
    body = "\n".join([
        f"Command: `python benchmarks/bench_scale_from_zero.py --trials {args.trials}`. Time to first token of a "
        "streamed completion (8 tokens) sent through the gateway's proxy while its model has no routed engine: "
        "the gateway holds it and asks for capacity once; a warm standby (an engine running with the model loaded, "
        "unrouted) is promoted by adding it to the gateway's pool, or an engine is started cold (`kubeinfer serve` "
        "loads the model and warms up). Model: the throughput benchmark's random-init Llama (8 layers, hidden 512), "
        "CPU, one torch thread. The gateway polls a pod that joins its pool within 20 ms "
        "(then every 0.25 s), and checks held requests every 20 ms. Not included (cluster-dependent): the operator's reaction to /scale and the watch "
        "event (0.08-0.09 s for a promotion against a real kube-apiserver), and a cold pod's scheduling, image "
        "pull and GPU initialisation, which only widen the gap.",
        "", "| first request | TTFT median (s) | min (s) | max (s) |", "|---|---|---|---|", *rows, "",
        f"A warm standby answers the first request {cold / standby:.1f}x sooner than a cold start here."])
    print(body)
    update_results("scale-from-zero", "Scale from zero: warm standby vs cold start", body)


if __name__ == "__main__":
    main()
