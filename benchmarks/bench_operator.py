"""Operator reconcile: time from InferenceModel creation to its Deployment, and scaling to hundreds of models.

Both against kmock's emulated API server on loopback (tests/operator_harness.py), with kopf in its
own thread as in the integration tests. The peer, run the same way: a bare kopf operator whose
create handler only POSTs a fixed Deployment, the floor that kopf and the emulator cost by themselves.

    python benchmarks/bench_operator.py [--models 300] [--samples 20] [--write]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import kopf

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests"))
from operator_harness import Cluster  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.operator.kube import KubeClient  # noqa: E402
from kubeinfer.operator.names import GROUP, PLURAL, VERSION  # noqa: E402

SPEC = {"model": {"uri": "pvc://models/llama"}, "replicas": 2, "standby": {"replicas": 1},
        "adapters": [{"name": "sql", "uri": "pvc://loras/sql"}, {"name": "chat", "uri": "hf://acme/chat"}]}


class BareCluster(Cluster):
    """The same emulator, with a minimal kopf operator instead of ours."""

    def __init__(self) -> None:
        super().__init__(operator=False)

    async def __aenter__(self) -> BareCluster:
        await super().__aenter__()
        registry, url = kopf.OperatorRegistry(), self.url

        async def connect() -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url)
        client = KubeClient(connect)  # its session opens in kopf's loop, like our operator's

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url)

        @kopf.on.cleanup(registry=registry)
        async def close(**_: Any) -> None:
            await client.close()

        @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
        async def create(name: str, namespace: str, **_: Any) -> None:
            labels = {"app": name}
            await client.request("POST", f"/apis/apps/v1/namespaces/{namespace}/deployments", {
                "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
                "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                         "template": {"metadata": {"labels": labels},
                                      "spec": {"containers": [{"name": "c", "image": "engine"}]}}}})

        self._stop, ready = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(kopf.operator(
            registry=registry, clusterwide=True, standalone=True, stop_flag=self._stop, ready_flag=ready)),
            daemon=True)
        self._thread.start()
        await asyncio.to_thread(ready.wait, 30)
        self.run_operator = True  # so __aexit__ stops the thread
        return self


async def wait_deployments(cluster: Cluster, names: list[str], timeout: float) -> None:
    deadline = time.perf_counter() + timeout
    missing = set(names)
    while missing:
        items = await cluster.api.list("apps/v1", "deployments", cluster.namespace)
        missing -= {d["metadata"]["name"] for d in items}
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(missing)} Deployments missing after {timeout}s")
        await asyncio.sleep(0.005)


async def latency(cluster: Cluster, samples: int, prefix: str) -> list[float]:
    """Create one model at a time; seconds until its Deployment is stored."""
    out = []
    for i in range(samples):
        name = f"{prefix}{i}"
        start = time.perf_counter()
        await cluster.create_model(name, SPEC)
        await wait_deployments(cluster, [name], 30)
        out.append(time.perf_counter() - start)
    return out


async def burst(cluster: Cluster, models: int, prefix: str) -> float:
    """Create `models` at once; seconds until every Deployment is stored."""
    names = [f"{prefix}{i}" for i in range(models)]
    start = time.perf_counter()
    await asyncio.gather(*(cluster.create_model(n, SPEC) for n in names))
    await wait_deployments(cluster, names, 600)
    return time.perf_counter() - start


async def status_sweep(cluster: Cluster, models: int, prefix: str) -> float:
    """After a burst, seconds until every model also has its status written (the full first pass)."""
    start = time.perf_counter()
    while True:
        items = await cluster.api.list(f"{GROUP}/{VERSION}", PLURAL, cluster.namespace)
        done = sum(1 for m in items if m["metadata"]["name"].startswith(prefix) and (m.get("status") or {}).get(
            "conditions"))
        if done >= models:
            return time.perf_counter() - start
        await asyncio.sleep(0.02)


async def run(models: int, samples: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    async with BareCluster() as bare:
        results["bare_latency"] = await latency(bare, samples, "lat-")
        results["bare_burst"] = await burst(bare, models, "burst-")
    async with Cluster(resync_seconds=3600) as ours:
        results["latency"] = await latency(ours, samples, "lat-")
        results["burst"] = await burst(ours, models, "burst-")
        results["status"] = await status_sweep(ours, models, "burst-")
    return results


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=300)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    r = asyncio.run(run(args.models, args.samples))
    ms = lambda v: f"{v * 1e3:.0f}"  # noqa: E731
    rows = [
        ("creation -> Deployment, one at a time (median / p95 ms)",
         f"{ms(statistics.median(r['latency']))} / {ms(p95(r['latency']))}",
         f"{ms(statistics.median(r['bare_latency']))} / {ms(p95(r['bare_latency']))}",
         f"{statistics.median(r['latency']) / statistics.median(r['bare_latency']):.2f}x"),
        (f"{args.models} created at once -> all Deployments (s)", f"{r['burst']:.2f}", f"{r['bare_burst']:.2f}",
         f"{r['burst'] / r['bare_burst']:.2f}x"),
        (f"{args.models} created at once -> models per second", f"{args.models / r['burst']:.0f}",
         f"{args.models / r['bare_burst']:.0f}", ""),
        (f"... then until all {args.models} have status (s)", f"{r['status']:.2f}", "n/a", ""),
    ]
    table = "| measure | kubeinfer operator | bare kopf handler | ratio |\n|---|---|---|---|\n" + \
        "\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)
    print(table)
    body = (f"Command: `python benchmarks/bench_operator.py --models {args.models} --samples {args.samples} --write`. "
            f"Machine: {platform.machine()}, {os.cpu_count()} cores; kopf {version('kopf')}, kmock {version('kmock')}, "
            "against kmock's emulated API server on loopback (same process, kopf in its own thread).\n"
            "Each model: 2 replicas + 1 standby, 2 adapters; our operator applies a Deployment, Service, "
            "PodDisruptionBudget and InferencePool, lists pods and writes status; the peer is a bare kopf "
            "create handler that POSTs one fixed Deployment (the cost of kopf and the emulator alone).\n\n" + table +
            "\n\nThe emulator shares the 2 cores with the operator, so these are upper bounds on operator cost, "
            "not a real API server's latency. Against kmock each first apply costs two requests (server-side "
            "apply answers 404, then a create); a real API server creates on apply.")
    if args.write:
        update_results("operator-reconcile", "Operator reconcile latency and scale (kmock)", body)


if __name__ == "__main__":
    main()
