"""The gateway watches InferenceModels and InferenceObjectives (kmock's API emulator on loopback): a model
created a moment ago is held and scaled up on its first request, not refused; edits to priority, fallback
and adapters count within the 1 s bound; a missing CRD leaves the resource out until it appears; the
periodic re-list corrects what a watch missed."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import kmock
from kubernetes import client as k8s_client

from kubeinfer.gateway.flowcontrol.model_priorities import INFERENCE_MODELS, ClusterPriorities
from kubeinfer.gateway.datastore.resource_watch import ResourceWatch

NS = "serving"
BOUND = 1.0  # seconds from an InferenceModel's creation or edit to the gateway acting on it (issue 33)
MODELS = f"/apis/serving.kubeinfer.io/v1alpha1/namespaces/{NS}/inferencemodels"
OBJECTIVES = f"/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{NS}/inferenceobjectives"


def inference_model(name: str, **spec) -> dict:
    return {"apiVersion": "serving.kubeinfer.io/v1alpha1", "kind": "InferenceModel",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"uri": f"pvc://models/{name}"}, **spec}}


async def within(condition, bound: float) -> float | None:
    """Seconds until `condition()` held, or None when it did not within `bound`."""
    start = time.monotonic()
    while time.monotonic() - start <= bound:
        if condition():
            return time.monotonic() - start
        await asyncio.sleep(0.01)
    return None


def emulator(objectives: bool = True):
    from operator_harness import RESOURCES, Emulator

    k8s = Emulator()
    for key, info in RESOURCES.items():
        k8s.resources[key] = info
    if objectives:
        k8s.resources["inference.networking.x-k8s.io/v1alpha2/inferenceobjectives"] = kmock.ResourceInfo(
            kind="InferenceObjective", namespaced=True, verbs={"create", "get", "list", "watch", "patch", "delete"})
    return k8s


async def create(api: httpx.AsyncClient, path: str, body: dict) -> None:
    response = await api.post(path, json=body)
    assert response.status_code in (200, 201), response.text


async def merge_patch(api: httpx.AsyncClient, path: str, body: dict) -> None:
    response = await api.patch(path, json=body, headers={"content-type": "application/merge-patch+json"})
    assert response.status_code == 200, response.text


async def test_edits_to_priority_fallback_and_adapters_apply_within_a_second():
    """The re-list is an hour away: only the watch can explain a change seen within the bound."""
    async with emulator() as k8s, kmock.Server(k8s) as server:
        url = str(server.url).rstrip("/")
        async with httpx.AsyncClient(base_url=url) as api:
            await create(api, MODELS, inference_model("first"))
            models, objectives, targets, fallbacks = {}, {}, {}, {}
            watcher = ClusterPriorities(models, objectives, namespace=NS, interval=3600, scale_targets=targets,
                                        fallbacks=fallbacks,
                                        api_client=k8s_client.ApiClient(k8s_client.Configuration(host=url)))
            watcher.start(asyncio.get_running_loop())
            try:
                assert await within(lambda: models == {"first": 0}, 10) is not None  # the first list
                await create(api, MODELS, inference_model("second", routing={"priority": -2}, minReplicas=2,
                                                          adapters=[{"name": "sql", "uri": "pvc://a/sql"}]))
                assert await within(lambda: models.get("second") == -2 and models.get("sql") == -2
                                    and targets.get("second") is not None, BOUND) is not None
                assert targets["sql"].name == "second" and targets["second"].min_replicas == 2
                await merge_patch(api, f"{MODELS}/second", {"spec": {"routing": {"priority": 3, "fallback": ["first"]},
                                                                     "adapters": [{"name": "chat",
                                                                                   "uri": "pvc://a/chat"}]}})
                assert await within(lambda: models.get("second") == 3 and "sql" not in models
                                    and models.get("chat") == 3 and fallbacks.get("second") == ["first"],
                                    BOUND) is not None
                await create(api, OBJECTIVES, {"apiVersion": "inference.networking.x-k8s.io/v1alpha2",
                                               "kind": "InferenceObjective",
                                               "metadata": {"name": "batch", "namespace": NS},
                                               "spec": {"priority": -5, "poolRef": {"name": "second"}}})
                assert await within(lambda: objectives == {"batch": -5}, BOUND) is not None
                assert (await api.delete(f"{MODELS}/second")).status_code == 200
                assert await within(lambda: models == {"first": 0} and "second" not in targets
                                    and not fallbacks, BOUND) is not None
                assert watcher.watches[INFERENCE_MODELS].lists == 1  # all of it came through the watch
            finally:
                watcher.stop()


def test_a_missing_crd_is_left_out_and_looked_for_again(monkeypatch):
    """No InferenceObjective CRD: InferenceModels still count; objectives are asked for once per re-list,
    not in a loop, and counted as soon as their CRD answers."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    calls: list[str] = []
    installed = threading.Event()

    class FakeApi:
        def __init__(self, api_client) -> None:
            pass

        def list_namespaced_custom_object(self, group, version, namespace, plural, **kwargs):
            if kwargs.get("watch"):  # a watch that stays quiet until it times out
                time.sleep(0.05)
                raise ApiException(status=500, reason="watch closed")
            calls.append(plural)
            if plural == "inferenceobjectives" and not installed.is_set():
                raise ApiException(status=404)
            if plural == "inferenceobjectives":
                return {"items": [{"metadata": {"name": "batch"}, "spec": {"priority": -1}}]}
            return {"items": [{"metadata": {"name": "llama"}, "spec": {"routing": {"priority": -1}}}]}

    monkeypatch.setattr(client, "CustomObjectsApi", FakeApi)
    models, objectives = {}, {"stale": 1}
    watcher = ClusterPriorities(models, objectives, namespace="ns", api_client=None, interval=0.5)
    loop = asyncio.new_event_loop()
    try:
        watcher.start(loop)
        loop.run_until_complete(within(lambda: models == {"llama": -1}, 10))
        loop.run_until_complete(asyncio.sleep(0.2))
        assert calls.count("inferenceobjectives") == 1 and objectives == {"stale": 1}
        installed.set()
        loop.run_until_complete(within(lambda: objectives == {"batch": -1}, 10))
        assert objectives == {"batch": -1}
    finally:
        watcher.stop()
        loop.close()


def test_the_resync_corrects_what_the_watch_missed():
    """A watch that delivers nothing (a server that drops events): the periodic list still brings the
    model in, so the safety net works on its own."""
    published: list[list[dict]] = []
    stop = threading.Event()
    items = [{"metadata": {"name": "a", "namespace": NS}}]

    class SilentApi:
        def list_namespaced_custom_object(self, *args, **kwargs):
            if kwargs.get("watch"):
                raise ApiGone()
            return {"items": list(items)}

    class ApiGone(Exception):
        pass

    watch = ResourceWatch(INFERENCE_MODELS, published.append, namespace=NS, api_client=None, resync=0.1, stop=stop)
    watch._lister = lambda api: (SilentApi().list_namespaced_custom_object, ("g", "v", NS, "p"))
    import kubeinfer.gateway.datastore.resource_watch as module
    module.RETRY_SECONDS, saved = 0.05, module.RETRY_SECONDS
    thread = threading.Thread(target=watch.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not published and time.monotonic() < deadline:
            time.sleep(0.01)
        items.append({"metadata": {"name": "b", "namespace": NS}})
        while time.monotonic() < deadline and not any(len(p) == 2 for p in published):
            time.sleep(0.01)
        assert any(len(p) == 2 for p in published)
    finally:
        stop.set()
        thread.join(5)
        module.RETRY_SECONDS = saved


async def test_a_new_models_first_request_is_held_scaled_up_and_answered(lora_base_dir):
    """An InferenceModel created a moment ago at replicas 0 with a warm standby: its first request (sent
    within the bound of its creation) is held, the gateway asks its /scale for a replica, and when the
    standby is promoted (played here by the test, as the operator would) the request is answered. Before
    the watch, the gateway learned of the model at its next 10 s poll and answered 503 at once."""
    from server_harness import RunningServer
    from test_gateway_discovery import create_pool, pod

    from kubeinfer.gateway.app import Gateway, GatewayConfig

    with RunningServer(lora_base_dir, name="llama") as engine:
        async with emulator() as k8s, kmock.Server(k8s) as server:
            url = str(server.url).rstrip("/")
            async with httpx.AsyncClient(base_url=url) as api:
                await create_pool(api, engine.port)
                await create(api, f"/api/v1/namespaces/{NS}/pods", pod("p1", "127.0.0.1", role="standby"))
                await create(api, MODELS, inference_model("other"))
                gateway = Gateway(GatewayConfig(host="127.0.0.1", port=0, ext_proc_port=None, metrics_port=None,
                                                namespace=NS, inference_pool="llama", scrape_interval=0.1,
                                                hold_timeout=30),
                                  api_client=k8s_client.ApiClient(k8s_client.Configuration(host=url)))
                gateway.discovery.watch_timeout = 1
                await gateway.start()
                try:
                    assert await within(lambda: "other" in gateway.router.discovered_priorities, 10) is not None
                    await create(api, MODELS, inference_model("llama", replicas=0, minReplicas=0,
                                                              standby={"replicas": 1}))
                    created = time.monotonic()
                    assert await within(lambda: "llama" in gateway.router.scalable, BOUND) is not None
                    async with httpx.AsyncClient(timeout=60) as http:
                        answer = asyncio.create_task(http.post(
                            f"http://127.0.0.1:{gateway.ports['proxy']}/v1/completions",
                            json={"model": "llama", "prompt": [1, 2, 3], "max_tokens": 2}))

                        async def replicas() -> int:
                            model = (await api.get(f"{MODELS}/llama")).json()
                            return (model.get("spec") or {}).get("replicas", 0)
                        while not answer.done() and await replicas() == 0:
                            await asyncio.sleep(0.02)
                        assert not answer.done(), answer.result().text  # held, not refused
                        assert time.monotonic() - created < 10  # asked for capacity at once
                        await merge_patch(api, f"/api/v1/namespaces/{NS}/pods/p1",
                                          {"metadata": {"labels": {"serving.kubeinfer.io/role": "active"}}})
                        response = await answer
                    assert response.status_code == 200, response.text
                    assert response.json()["choices"][0]["text"] is not None
                finally:
                    await gateway.stop()
