"""Gateway endpoint discovery against a Kubernetes API emulator (kmock) on loopback: an InferencePool's
selector and port, only Running + Ready + active pods, adapter placement from the pod annotation, and
membership that follows pod changes through the watch."""
from __future__ import annotations

import asyncio

import httpx
import kmock
import pytest
from kubernetes import client as k8s_client

from kubeinfer.gateway.datastore.discovery import KubernetesDiscovery, endpoint_of, parse_address, pool_selector
from kubeinfer.gateway.datastore.endpoints import EndpointPool

VERBS = {"create", "get", "list", "watch", "patch", "delete"}
NS = "serving"
MODEL_LABELS = {"serving.kubeinfer.io/inference-model": "llama"}


def pod(name: str, ip: str, *, role="active", ready=True, phase="Running", adapters=None, labels=None) -> dict:
    annotations = {"serving.kubeinfer.io/adapters": adapters} if adapters is not None else {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "annotations": annotations,
                         "labels": {**MODEL_LABELS, "serving.kubeinfer.io/role": role, **(labels or {})}},
            "spec": {"containers": [{"name": "engine", "image": "engine"}]},
            "status": {"phase": phase, "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_endpoint_of_filters_pods():
    selector = dict(MODEL_LABELS)
    assert endpoint_of(pod("a", "10.0.0.1", adapters="x, y"), selector, 8000).placed_adapters == {"x", "y"}
    assert endpoint_of(pod("a", "10.0.0.1"), selector, 8000).address == "10.0.0.1:8000"
    assert endpoint_of(pod("a", "fd00::1"), selector, 8000).address == "[fd00::1]:8000"
    for rejected in (pod("a", "10.0.0.1", role="standby"), pod("a", "10.0.0.1", ready=False),
                     pod("a", "10.0.0.1", phase="Pending"), pod("a", "", ready=True),
                     pod("a", "10.0.0.1", labels={"serving.kubeinfer.io/inference-model": "other"})):
        assert endpoint_of(rejected, selector, 8000) is None
    terminating = pod("a", "10.0.0.1")
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert endpoint_of(terminating, selector, 8000) is None
    assert pool_selector({"spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 9000}]}}) == \
        ({"a": "b"}, 9000)
    assert pool_selector({"spec": {"selector": {"a": "b"}, "targetPortNumber": 8001}}) == ({"a": "b"}, 8001)
    assert parse_address("http://localhost:8000/") == "localhost:8000"
    with pytest.raises(ValueError, match="host and a port"):
        parse_address("http://no-port")


async def wait_for(condition, timeout: float = 10.0) -> bool:
    for _ in range(int(timeout / 0.05)):
        if condition():
            return True
        await asyncio.sleep(0.05)
    return condition()


def declare(k8s) -> None:
    """The resources the gateway reads, for kmock's discovery."""
    k8s.resources["v1/pods"] = kmock.ResourceInfo(kind="Pod", namespaced=True, verbs=VERBS, subresources={"status"})
    k8s.resources["inference.networking.k8s.io/v1/inferencepools"] = kmock.ResourceInfo(
        kind="InferencePool", namespaced=True, verbs=VERBS)


async def create_pool(api: httpx.AsyncClient, port: int) -> None:
    """An InferencePool named llama selecting MODEL_LABELS, its engines on `port`."""
    response = await api.post(f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools", json={
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "llama", "namespace": NS},
        "spec": {"selector": {"matchLabels": dict(MODEL_LABELS)}, "targetPorts": [{"number": port}],
                 "endpointPickerRef": {"name": "gateway", "port": {"number": 9002}}}})
    assert response.status_code in (200, 201), response.text


async def test_discovery_follows_pods_of_an_inference_pool():
    async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as server:
        declare(k8s)
        url = str(server.url).rstrip("/")
        async with httpx.AsyncClient(base_url=url) as api:
            await create_pool(api, 8123)
            for item in (pod("p1", "10.0.0.1", adapters="sql"), pod("p2", "10.0.0.2", role="standby"),
                         pod("p3", "10.0.0.3", ready=False), pod("other", "10.0.0.9", labels={
                             "serving.kubeinfer.io/inference-model": "mistral"})):
                assert (await api.post(f"/api/v1/namespaces/{NS}/pods", json=item)).status_code in (200, 201)

            pool = EndpointPool()
            configuration = k8s_client.Configuration(host=url)
            discovery = KubernetesDiscovery(pool, namespace=NS, inference_pool="llama",
                                            api_client=k8s_client.ApiClient(configuration), watch_timeout=1)
            discovery.start(asyncio.get_running_loop())
            try:
                def addresses() -> set[str]:
                    return {e.address for e in pool}

                assert await wait_for(lambda: addresses() == {"10.0.0.1:8123"})  # the pool's port, active + ready only
                assert pool.endpoints["10.0.0.1:8123"].placed_adapters == {"sql"}

                async def patch(name: str, body: dict) -> None:
                    response = await api.patch(f"/api/v1/namespaces/{NS}/pods/{name}", json=body,
                                               headers={"content-type": "application/merge-patch+json"})
                    assert response.status_code == 200, response.text

                await patch("p2", {"metadata": {"labels": {"serving.kubeinfer.io/role": "active"}}})  # promoted
                await patch("p3", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})  # became ready
                assert await wait_for(lambda: addresses() == {"10.0.0.1:8123", "10.0.0.2:8123", "10.0.0.3:8123"})
                await patch("p1", {"metadata": {"annotations": {"serving.kubeinfer.io/adapters": "sql,chat"}}})
                assert await wait_for(lambda: pool.endpoints["10.0.0.1:8123"].placed_adapters == {"sql", "chat"})
                await patch("p2", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
                await api.delete(f"/api/v1/namespaces/{NS}/pods/p3")
                assert await wait_for(lambda: addresses() == {"10.0.0.1:8123"})
            finally:
                discovery.stop()


def test_objective_priorities_of_inference_objectives():
    from kubeinfer.gateway.flowcontrol.model_priorities import objective_priorities_of

    objectives = [{"metadata": {"name": "batch"}, "spec": {"priority": -3, "poolRef": {"name": "llama"}}},
                  {"metadata": {"name": "default"}, "spec": {"poolRef": {"name": "llama"}}}]
    assert objective_priorities_of(objectives) == {"batch": -3, "default": 0}


def test_priorities_of_inference_models():
    from kubeinfer.gateway.flowcontrol.model_priorities import priorities_of

    models = [{"metadata": {"name": "llama"}, "spec": {"model": {"servedName": "llama-3"}, "routing": {"priority": -1},
                                                         "adapters": [{"name": "sql"}, {"name": "chat"}]}},
              {"metadata": {"name": "qwen"}, "spec": {}}]
    assert priorities_of(models) == {"llama-3": -1, "sql": -1, "chat": -1, "qwen": 0}


async def test_gateway_in_kubernetes_mode_routes_to_discovered_pods(lora_base_dir):
    """The whole gateway against kmock: a pod whose IP and port are a real engine on loopback, an
    InferencePool selecting it, and an InferenceModel whose negative priority makes its requests sheddable."""
    from server_harness import RunningServer

    from kubeinfer.gateway.app import Gateway, GatewayConfig

    with RunningServer(lora_base_dir, name="llama") as engine:
        async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as server:
            declare(k8s)
            k8s.resources["serving.kubeinfer.io/v1alpha1/inferencemodels"] = kmock.ResourceInfo(
                kind="InferenceModel", namespaced=True, verbs=VERBS)
            k8s.resources["inference.networking.x-k8s.io/v1alpha2/inferenceobjectives"] = kmock.ResourceInfo(
                kind="InferenceObjective", namespaced=True, verbs=VERBS)
            url = str(server.url).rstrip("/")
            async with httpx.AsyncClient(base_url=url) as api:
                await create_pool(api, engine.port)
                await api.post(f"/api/v1/namespaces/{NS}/pods", json=pod("p1", "127.0.0.1"))
                await api.post(f"/apis/serving.kubeinfer.io/v1alpha1/namespaces/{NS}/inferencemodels", json={
                    "apiVersion": "serving.kubeinfer.io/v1alpha1", "kind": "InferenceModel",
                    "metadata": {"name": "llama", "namespace": NS},
                    "spec": {"model": {"uri": "pvc://models/llama"}, "routing": {"priority": -1}}})
                await api.post(f"/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{NS}/inferenceobjectives",
                               json={"apiVersion": "inference.networking.x-k8s.io/v1alpha2",
                                     "kind": "InferenceObjective", "metadata": {"name": "interactive", "namespace": NS},
                                     "spec": {"priority": 5, "poolRef": {"name": "llama"}}})
            gateway = Gateway(GatewayConfig(host="127.0.0.1", port=0, ext_proc_port=None, metrics_port=None,
                                            namespace=NS, inference_pool="llama", scrape_interval=0.1,
                                            trust_priority_headers=True),
                              api_client=k8s_client.ApiClient(k8s_client.Configuration(host=url)))
            gateway.discovery.watch_timeout = 1
            gateway.priorities.interval = 0.2
            await gateway.start()
            try:
                assert await wait_for(lambda: bool(gateway.picker.ready_endpoints()))
                assert await wait_for(lambda: gateway.router.discovered_priorities == {"llama": -1})
                async with httpx.AsyncClient() as http:
                    response = await http.post(f"http://127.0.0.1:{gateway.ports['proxy']}/v1/completions", json={
                        "model": "llama", "prompt": [1, 2, 3], "max_tokens": 2}, timeout=30)
                assert response.status_code == 200, response.text
                assert response.headers["x-gateway-destination-endpoint"] == f"127.0.0.1:{engine.port}"
                parsed, _ = gateway.router.route(b'{"model": "llama", "prompt": "x"}', {})
                assert parsed.sheddable  # from the InferenceModel's routing priority
                assert await wait_for(lambda: gateway.router.objective_priorities == {"interactive": 5})
                parsed, _ = gateway.router.route(b'{"model": "llama", "prompt": "x"}',
                                                 {"x-gateway-inference-objective": "interactive"})
                assert not parsed.sheddable  # the objective the request names outranks the model
            finally:
                await gateway.stop()


async def test_forbidden_discovery_is_one_clear_log_line_and_a_metric(caplog):
    """The gateway's ServiceAccount may not list pods (the quick start's namespace mismatch): it says so
    once, in one line naming what to grant, counts it, and recovers when the permission arrives."""
    import logging

    from operator_harness import RESOURCES, Emulator

    from kubeinfer.gateway.handlers.metrics import GatewayMetrics
    from kubeinfer.gateway.scheduling.picker import Picker

    async with Emulator() as k8s, kmock.Server(k8s) as server:
        for key, info in RESOURCES.items():
            k8s.resources[key] = info
        k8s.refuse("GET", "pods", 403, 'pods is forbidden: User "system:serviceaccount:kubeinfer:gw" cannot list '
                                       'resource "pods" in API group "" in the namespace "default"')
        pool = EndpointPool()
        discovery = KubernetesDiscovery(pool, namespace="default", selector={"app": "x"}, watch_timeout=1,
                                        api_client=k8s_client.ApiClient(k8s_client.Configuration(
                                            host=str(server.url).rstrip("/"))))
        metrics = GatewayMetrics(Picker(pool))
        metrics.discovery = discovery
        with caplog.at_level(logging.INFO, logger="kubeinfer.gateway.datastore.discovery"):
            discovery.start(asyncio.get_running_loop())
            try:
                assert await wait_for(lambda: discovery.failures.get("forbidden", 0) >= 1)
                from prometheus_client import generate_latest
                text = generate_latest(metrics.registry).decode()
                assert 'kubeinfer_gateway_discovery_failures_total{reason="forbidden"} 1.0' in text
                errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
                assert len(errors) == 1 and "\n" not in errors[0].getMessage()
                assert "may not list pods in namespace default" in errors[0].getMessage()
                assert "Traceback" not in caplog.text
            finally:
                discovery.stop()
