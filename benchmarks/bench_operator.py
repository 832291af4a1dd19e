"""Operator reconcile: time from InferenceModel creation to its Deployment, and scaling to hundreds of models;
then the operator's promises under faults: an active pod deleted -> a ready standby labelled active, and a
Deployment deleted or edited by hand -> repaired (both watch-driven, with the resync timer set to an hour).

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

from kubeinfer.operator.kube import KubeClient, api_path  # noqa: E402
from kubeinfer.operator.names import GROUP, PLURAL, ROLE_LABEL, VERSION  # noqa: E402

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


async def _until(check, timeout: float = 30.0, interval: float = 0.002) -> float:
    """Seconds until the async `check` is true, polled every `interval`."""
    start = time.perf_counter()
    while not await check():
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"not within {timeout} s")
        await asyncio.sleep(interval)
    return time.perf_counter() - start


async def _roles(cluster: Cluster, name: str) -> dict[str, str | None]:
    return {p["metadata"]["name"]: p["metadata"].get("labels", {}).get(ROLE_LABEL) for p in await cluster.pods(name)}


async def _complete(cluster: Cluster, name: str) -> bool:
    status = (await cluster.model(name)).get("status") or {}
    return any(c["type"] == "Progressing" and c["reason"] == "Complete" for c in status.get("conditions") or [])


async def promotion(cluster: Cluster, samples: int) -> list[float]:
    """Delete the active pod; seconds until the ready standby is labelled active. Then restore the standby."""
    name = "promote"
    await cluster.create_model(name, {**SPEC, "replicas": 1, "adapters": []})
    await _until(lambda: cluster.get("apps/v1", "deployments", name))
    out = []
    for _ in range(samples + 1):
        for pod in await cluster.sync_pods(name):  # the Deployment controller and kubelet's part
            await cluster.set_ready(pod, True)

        async def settled() -> bool:  # status can still say Complete from before the pod was replaced
            return sorted(map(str, (await _roles(cluster, name)).values())) == ["active", "standby"] and \
                await _complete(cluster, name)
        await _until(settled)
        roles = await _roles(cluster, name)
        active = next(p for p, r in roles.items() if r == "active")
        standby = next(p for p, r in roles.items() if r == "standby")
        await cluster.delete_pod(active)
        start = time.perf_counter()

        async def promoted(standby: str = standby) -> bool:
            return (await _roles(cluster, name)).get(standby) == "active"
        await _until(promoted)
        out.append(time.perf_counter() - start)
    return out[1:]  # the first sample warms the connection pools


async def repair(cluster: Cluster, samples: int) -> tuple[list[float], list[float]]:
    """Seconds from a hand edit of the Deployment's replicas, and from its deletion, until repaired."""
    name = "repair"
    await cluster.create_model(name, SPEC)
    await _until(lambda: cluster.get("apps/v1", "deployments", name))
    want = (await cluster.get("apps/v1", "deployments", name))["spec"]["replicas"]

    async def restored() -> bool:
        d = await cluster.get("apps/v1", "deployments", name)
        return d is not None and d["spec"]["replicas"] == want
    edits, deletions = [], []
    for _ in range(samples + 1):
        await asyncio.sleep(0.05)  # let the previous repair's own watch event settle
        await cluster.api.patch("apps/v1", "deployments", cluster.namespace, name, {"spec": {"replicas": want + 5}})
        edits.append(await _until(restored))
        await asyncio.sleep(0.05)
        await cluster.api.request("DELETE", api_path("apps/v1", "deployments", cluster.namespace, name))
        deletions.append(await _until(restored))
    return edits[1:], deletions[1:]


async def run(models: int, samples: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    async with BareCluster() as bare:
        results["bare_latency"] = await latency(bare, samples, "lat-")
        results["bare_burst"] = await burst(bare, models, "burst-")
    async with Cluster(resync_seconds=3600) as ours:
        results["latency"] = await latency(ours, samples, "lat-")
        results["burst"] = await burst(ours, models, "burst-")
        results["status"] = await status_sweep(ours, models, "burst-")
    async with Cluster(resync_seconds=3600) as faults:  # no timer can do the work: only watch events
        results["promotion"] = await promotion(faults, samples)
        results["edit_repair"], results["delete_repair"] = await repair(faults, samples)
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
    before = {"promotion": "next pod event (watch-driven already)", "edit_repair": "300 s timer",
              "delete_repair": "300 s timer"}
    fault_rows = [
        ("active pod deleted -> ready standby labelled active", r["promotion"], before["promotion"]),
        ("Deployment replicas edited by hand -> restored", r["edit_repair"], before["edit_repair"]),
        ("Deployment deleted -> re-created", r["delete_repair"], before["delete_repair"]),
    ]
    faults = "| fault (resync timer 1 h) | median / p95 / max ms | before issue #16 |\n|---|---|---|\n" + "\n".join(
        f"| {label} | {ms(statistics.median(v))} / {ms(p95(v))} / {ms(max(v))} | {was} |"
        for label, v, was in fault_rows)
    table = "| measure | kubeinfer operator | bare kopf handler | ratio |\n|---|---|---|---|\n" + \
        "\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)
    print(table + "\n\n" + faults)
    body = (f"Command: `python benchmarks/bench_operator.py --models {args.models} --samples {args.samples} --write`. "
            f"Machine: {platform.machine()}, {os.cpu_count()} cores; kopf {version('kopf')}, kmock {version('kmock')}, "
            "against kmock's emulated API server on loopback (same process, kopf in its own thread).\n"
            "Each model: 2 replicas + 1 standby, 2 adapters; our operator applies a Deployment, Service, "
            "PodDisruptionBudget and InferencePool, lists pods and writes status; the peer is a bare kopf "
            "create handler that POSTs one fixed Deployment (the cost of kopf and the emulator alone).\n\n" + table +
            "\n\nThe emulator shares the 2 cores with the operator, so these are upper bounds on operator cost, "
            "not a real API server's latency. Against kmock each first apply costs two requests (server-side "
            "apply answers 404, then a create); a real API server creates on apply.\n\n"
            f"Faults, {args.samples} samples each, 1 active + 1 standby for promotion, 2 + 1 for repairs; times "
            "include the test's 2 ms polling:\n\n" + faults)
    if args.write:
        update_results("operator-reconcile", "Operator reconcile latency and scale (kmock)", body)


if __name__ == "__main__":
    main()
