"""The real kopf operator (in a thread of its own) against kmock's Kubernetes emulator on loopback.

kmock stores objects and serves list / watch / patch, but runs no controllers: `Cluster.sync_pods`
plays the Deployment controller (creates or removes pods to match spec.replicas) and
`Cluster.set_ready` plays the kubelet. `Emulator` adds what kopf relies on and kmock leaves out:
a new resourceVersion on every write (kopf waits for it after its own patches), a generation
that counts spec changes (through /scale too), optimistic concurrency (a PATCH naming an old
metadata.resourceVersion gets 409, as from a real API server), refusals a test injects (`refuse`:
403, 422, 500 ... for chosen calls) and a count of writes per resource; it keeps no request history,
which kmock's request matching scans. uid and creationTimestamp are set by whoever creates an object.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
import itertools
import threading
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp.web
import kmock
import kopf

from kubeinfer.operator.autoscale import QueueDepthSource
from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.handlers import register
from kubeinfer.operator.kube import KubeClient
from kubeinfer.operator.loaded import Observed
from kubeinfer.operator.names import ADAPTERS_ANNOTATION, API_VERSION, PLURAL, selector_labels
from kubeinfer.operator.pods import parse_adapters
from kubeinfer.operator.reconcile import Reconciler

VERBS = {"create", "get", "list", "watch", "patch", "delete"}
RESOURCES = {
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs=VERBS),
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=VERBS),
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True, verbs=VERBS),
    "v1/pods": kmock.ResourceInfo(kind="Pod", namespaced=True, verbs=VERBS, subresources={"status"}),
    "v1/services": kmock.ResourceInfo(kind="Service", namespaced=True, verbs=VERBS),
    "apps/v1/deployments": kmock.ResourceInfo(kind="Deployment", namespaced=True, verbs=VERBS,
                                              subresources={"status", "scale"}),
    "policy/v1/poddisruptionbudgets": kmock.ResourceInfo(kind="PodDisruptionBudget", namespaced=True, verbs=VERBS),
    "networking.k8s.io/v1/networkpolicies": kmock.ResourceInfo(kind="NetworkPolicy", namespaced=True, verbs=VERBS),
    "v1/secrets": kmock.ResourceInfo(kind="Secret", namespaced=True, verbs=VERBS),
    f"{API_VERSION}/{PLURAL}": kmock.ResourceInfo(kind="InferenceModel", namespaced=True, verbs=VERBS,
                                                  subresources={"status", "scale"}),
}
POOLS = {"inference.networking.k8s.io/v1/inferencepools": kmock.ResourceInfo(
    kind="InferencePool", namespaced=True, verbs=VERBS, subresources={"status"})}
_clock = itertools.count()


def status_response(code: int, message: str) -> aiohttp.web.Response:
    reasons = {403: "Forbidden", 404: "NotFound", 409: "Conflict", 422: "Invalid", 500: "InternalError"}
    return aiohttp.web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                                      "reason": reasons.get(code, "Unknown"), "code": code}, status=code)


class Emulator(kmock.KubernetesEmulator):
    _versions = itertools.count(1)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refusals: list[dict[str, Any]] = []
        self.writes: collections.Counter[tuple[str, str]] = collections.Counter()  # (method, plural[/sub])
        self.conflicts = 0  # PATCHes refused for naming an old resourceVersion

    def refuse(self, method: str, plural: str, code: int, message: str, subresource: str | None = None,
               times: int | None = None) -> None:
        """Answer `code` to METHOD on `plural` (every time, or the next `times` times) until `allow()`."""
        self.refusals.append({"method": method, "plural": plural, "subresource": subresource, "code": code,
                              "message": message, "times": times})

    def allow(self) -> None:
        self.refusals.clear()

    def _refusal(self, request: kmock.Request) -> aiohttp.web.Response | None:
        for rule in self.refusals:
            if (rule["method"] == str(request.method.value).upper() and request.resource is not None
                    and rule["plural"] == request.resource.plural and rule["subresource"] == request.subresource):
                if rule["times"] is not None:
                    rule["times"] -= 1
                    if rule["times"] <= 0:
                        self.refusals.remove(rule)
                return status_response(rule["code"], rule["message"])
        return None

    def _stale(self, request: kmock.Request) -> bool:
        """A PATCH that names a resourceVersion other than the stored one (the API server's precondition)."""
        wanted = ((request.data or {}).get("metadata") or {}).get("resourceVersion") \
            if isinstance(request.data, dict) else None
        key = (request.resource, request.namespace, request.name)
        if wanted is None or key not in self.objects:
            return False
        return (self.objects[key].get("metadata") or {}).get("resourceVersion") != wanted

    async def _handle(self, request: kmock.Request):
        # kmock matches each request against its whole request history (for assertions we do not
        # use): keeping only the current one stops every request getting slower than the last.
        del self._requests[:-1]
        if (refused := self._refusal(request)) is not None:
            return refused
        data = request.data
        if request.resource is not None and request.action == kmock.action.UPDATE and self._stale(request):
            self.conflicts += 1
            return status_response(409, f"Operation cannot be fulfilled on {request.resource.plural} "
                                        f"\"{request.name}\": the object has been modified; please apply your "
                                        "changes to the latest version and try again")
        if request.resource is not None and request.method.value.upper() in ("POST", "PATCH", "PUT", "DELETE"):
            plural = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
            self.writes[(request.method.value.upper(), plural)] += 1
        if request.resource is not None and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            version = str(next(self._versions))
            if isinstance(data, list):  # a JSON patch
                data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
            elif isinstance(data, dict):
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = version
                if request.action == kmock.action.CREATE:
                    meta.setdefault("generation", 1)
                elif "spec" in data and request.subresource in (None, "scale"):
                    key = (request.resource, request.namespace, request.name)
                    stored = self.objects[key].get("metadata", {}) if key in self.objects else {}
                    meta["generation"] = int(stored.get("generation") or 0) + 1
        return await super()._handle(request)


def _stamp() -> str:
    """Strictly increasing creation timestamps, so 'older pod' is well defined within a test."""
    base = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(seconds=next(_clock))
    return base.strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeQueueDepths:
    """Queue depths the test sets, per pod name or for every pod."""

    def __init__(self) -> None:
        self.every: float | None = None

    async def queue_depths(self, pods) -> dict[str, float]:
        return {p.name: self.every for p in pods} if self.every is not None else {}

    async def activity(self, pods) -> dict[str, float]:
        """Requests running or waiting: the waiting ones here (a test that wants busy sets every > 0)."""
        return await self.queue_depths(pods)


class FakeEngines:
    """Plays each engine's GET /v1/models: a pod serves what its annotation assigns it (read from the
    API, as the engine reads it through the downward API), except the loads a test makes fail."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.client: KubeClient | None = None  # the reconciler's, so requests stay in kopf's loop
        self.failing: set[tuple[str, str]] = set()  # (pod, adapter) whose load fails
        self.unreachable: set[str] = set()

    async def observe(self, pods) -> Observed:
        loaded, unknown = {}, {}
        for pod in pods:
            if pod.name in self.unreachable:
                unknown[pod.name] = "GET /v1/models failed: ConnectTimeout"
                continue
            body = await self.client.get("v1", "pods", self.namespace, pod.name)
            assigned = parse_adapters(((body or {}).get("metadata", {}).get("annotations") or {})
                                      .get(ADAPTERS_ANNOTATION))
            loaded[pod.name] = tuple(a for a in assigned if (pod.name, a) not in self.failing)
        return Observed(loaded, unknown)


class Cluster:
    def __init__(self, with_pools: bool = True, resync_seconds: float = 30.0,
                 metrics: QueueDepthSource | None = None, namespace: str = "default", operator: bool = True,
                 config: OperatorConfig | None = None, resources: dict[str, kmock.ResourceInfo] | None = None):
        self.with_pools = with_pools
        self.extra_resources = resources or {}  # more APIs the cluster serves (e.g. LeaderWorkerSets)
        self.run_operator = operator
        self.resync_seconds = resync_seconds
        self.config = dataclasses.replace(config or OperatorConfig(), resync_seconds=resync_seconds)
        self.metrics = metrics or FakeQueueDepths()
        self.engines = FakeEngines(namespace)
        self.namespace = namespace
        self._stack = contextlib.AsyncExitStack()
        self._pod_numbers = itertools.count()

    async def __aenter__(self) -> Cluster:
        self.k8s = await self._stack.enter_async_context(Emulator())
        server = await self._stack.enter_async_context(kmock.Server(self.k8s))
        for key, info in {**RESOURCES, **(POOLS if self.with_pools else {}), **self.extra_resources}.items():
            self.k8s.resources[key] = info
        self.url = url = str(server.url).rstrip("/")

        async def connect() -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url)

        self.api = KubeClient(connect)
        self.reconciler = Reconciler(KubeClient(connect), self.config, self.metrics, self.engines)
        self.engines.client = self.reconciler.client
        if not self.run_operator:
            return self
        registry = kopf.OperatorRegistry()
        register(registry, self.reconciler, connect)
        # kopf gets a thread and loop of its own: on exit it waits for, then cancels, every task
        # started in its loop after it, which here would include kmock's connection handlers.
        self._stop, ready = threading.Event(), threading.Event()

        def operate() -> None:
            asyncio.run(kopf.operator(registry=registry, clusterwide=True, standalone=True,
                                      stop_flag=self._stop, ready_flag=ready))
        self._thread = threading.Thread(target=operate, name="kopf", daemon=True)
        self._thread.start()
        if not await asyncio.to_thread(ready.wait, 30):
            raise RuntimeError("kopf did not start within 30 s")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.run_operator:
            self._stop.set()
            await asyncio.to_thread(self._thread.join, 20)
        await self.api.close()
        await self._stack.aclose()

    # -- the API server's part -----------------------------------------------------------------------
    async def create_model(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        body = {"apiVersion": API_VERSION, "kind": "InferenceModel",
                "metadata": {"name": name, "namespace": self.namespace, "uid": str(uuid.uuid4()),
                             "creationTimestamp": _stamp()},
                "spec": spec}
        return await self.api.request("POST", f"/apis/{API_VERSION}/namespaces/{self.namespace}/{PLURAL}", body)

    async def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        await self.api.patch(API_VERSION, PLURAL, self.namespace, name, {"spec": spec})

    async def delete_model(self, name: str) -> None:
        await self.api.request("DELETE", f"/apis/{API_VERSION}/namespaces/{self.namespace}/{PLURAL}/{name}")

    async def model(self, name: str) -> dict[str, Any]:
        return await self.api.get(API_VERSION, PLURAL, self.namespace, name)

    async def get(self, api_version: str, plural: str, name: str) -> dict[str, Any] | None:
        return await self.api.get(api_version, plural, self.namespace, name)

    async def pods(self, name: str) -> list[dict[str, Any]]:
        return sorted(await self.api.list("v1", "pods", self.namespace, selector_labels(name)),
                      key=lambda p: p["metadata"]["name"])

    async def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        items = await self.api.list("v1", "events", self.namespace)
        return [e for e in items if reason is None or e.get("reason") == reason]

    # -- the controllers' part -----------------------------------------------------------------------
    async def sync_pods(self, name: str) -> list[str]:
        """Play the Deployment controller once: as many pods as spec.replicas, from the pod template."""
        deployment = await self.get("apps/v1", "deployments", name)
        template = deployment["spec"]["template"]
        pods = await self.pods(name)
        want = deployment["spec"]["replicas"]
        for pod in pods[want:][::-1]:
            await self.delete_pod(pod["metadata"]["name"])
        taken = {p["metadata"]["name"] for p in pods}
        while len(taken) < want:
            i = next(self._pod_numbers)  # never reuse a name, as the ReplicaSet's random suffixes do not
            pod_name = f"{name}-{i:03d}"
            taken.add(pod_name)
            await self.api.request("POST", f"/api/v1/namespaces/{self.namespace}/pods", {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": self.namespace, "uid": str(uuid.uuid4()),
                             "creationTimestamp": _stamp(), **{k: dict(v) for k, v in template["metadata"].items()}},
                "spec": template["spec"], "status": {"phase": "Pending", "podIP": f"10.0.{i // 250}.{i % 250 + 1}"}})
        return sorted(taken)

    async def set_ready(self, pod: str, ready: bool) -> None:
        condition = {"type": "Ready", "status": "True" if ready else "False"}
        await self.api.patch("v1", "pods", self.namespace, pod,
                             {"status": {"phase": "Running", "conditions": [condition]}})

    async def delete_pod(self, pod: str) -> None:
        await self.api.request("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{pod}")


async def eventually(check: Callable[[], Any], timeout: float = 15.0, interval: float = 0.05) -> Any:
    """Poll an async or sync predicate until it returns something truthy; fail with its last value."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value: {value!r})")
        await asyncio.sleep(interval)
