"""kubeinfer on a real cluster, as a user runs it (issue #46): the images built and loaded, the chart installed with
the README's command, tiny models applied as InferenceModels, requests through the gateway Service. The tests run
in file order and share the release; each is one step of the transcript (`make e2e` prints it)."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from e2e_cluster import (ROOT, TRANSCRIPT, E2EError, condition, get, helm, kubectl, model_state, wait_until)
from e2e_models import hub_standin, inference_model, volume, write_adapter, write_model

ENGINE_SELECTOR = "app.kubernetes.io/name=kubeinfer-engine"


@pytest.fixture(scope="module")
def store(release, node_dir) -> dict:
    """The tiny model and three adapters: one beside the model on its claim, one on a claim of its own, one in a
    host folder for file://."""
    with TRANSCRIPT.step("write models and volumes (kubeinfer random-model)"):
        models = node_dir / "models"
        tiny = write_model(models / "tiny")
        write_adapter(models / "adapters" / "sql", tiny, seed=1)
        write_adapter(node_dir / "adapters" / "chat", tiny, seed=2)
        write_adapter(node_dir / "host" / "legal", tiny, seed=3)
        volume("models", models)
        volume("adapters", node_dir / "adapters")
    return {"host": node_dir / "host"}


def wait_ready(name: str, timeout: float, replicas: int = 1, standby: int = 0) -> dict:
    """Ready=True with `replicas` active and `standby` standby pods ready (Ready alone means one pod serves)."""
    def ready():
        im = get("inferencemodel", name)
        status = im.get("status", {})
        return im if (condition(im, "Ready").get("status") == "True" and status.get("readyReplicas") == replicas
                      and status.get("standbyReplicas", 0) == standby) else None
    return wait_until(f"InferenceModel {name} Ready with {replicas} active and {standby} standby pods", ready,
                      timeout, every=2, seen=lambda: model_state(name))


def served(gateway, model: str, timeout: float = 120) -> dict:
    """A completion through the gateway, retried until the gateway routes to the model (discovery takes a moment)."""
    def complete():
        r = httpx.post(f"{gateway.url}/v1/completions", timeout=60,
                       json={"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0})
        if r.status_code != 200:
            raise E2EError(f"{r.status_code} {r.text[:300]}")
        return r.json()
    return wait_until(f"a completion of {model} through the gateway", complete, timeout, every=2)


def test_chart_pods_ready(release):
    with TRANSCRIPT.step("operator and gateway Ready"):
        for deployment in ("kubeinfer-operator", "kubeinfer-gateway"):
            kubectl("rollout", "status", f"deployment/{deployment}", "--timeout=240s", timeout=260)


def test_a_model_serves_completions_and_streamed_chat(store, gateway):
    with TRANSCRIPT.step("model tiny Ready (2 active + 1 standby, pvc://)"):
        kubectl("apply", "-f", "-", input=json.dumps(inference_model("tiny", "pvc://models/tiny", replicas=2,
                                                                      standby=1)))
        wait_ready("tiny", 420, replicas=2, standby=1)
    with TRANSCRIPT.step("completion through the gateway Service"):
        gateway.start()
        body = served(gateway, "tiny")
        assert body["choices"][0]["text"] and body["model"] == "tiny"
    with TRANSCRIPT.step("streamed chat through the gateway Service"):
        chunks = []
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "stream": True, "max_tokens": 8,
                                "messages": [{"role": "user", "content": "Hello"}]}) as r:
            assert r.status_code == 200
            chunks = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert chunks[-1] == "data: [DONE]" and len(chunks) >= 3
        assert json.loads(chunks[0][6:])["object"] == "chat.completion.chunk"


def test_status_after_a_bad_spec_and_after_its_fix(store):
    with TRANSCRIPT.step("bad spec: conditions say why"):
        kubectl("apply", "-f", "-", input=json.dumps(inference_model("broken", "pvc://models/missing")))

        def failing():
            ready = condition(get("inferencemodel", "broken"), "Ready")
            why = ready.get("message", "")
            return ready if ready.get("status") == "False" and ("config.json" in why or "not exist" in why) else None
        ready = wait_until("broken: Ready=False with the engine's own error", failing, 240, every=2,
                           seen=lambda: model_state("broken"))
        TRANSCRIPT.add("  Ready=False", 0.0, f"{ready['reason']}: {ready['message'][:100]}")
    with TRANSCRIPT.step("spec fixed: Ready=True, no stale message"):
        kubectl("patch", "inferencemodel", "broken", "--type=merge", "-p",
                json.dumps({"spec": {"model": {"uri": "pvc://models/tiny"}}}))
        im = wait_ready("broken", 300)
        assert "config.json" not in json.dumps(im["status"].get("conditions", []))
        kubectl("delete", "inferencemodel", "broken", "--timeout=120s", timeout=150)


def active_pods(model: str) -> list[dict]:
    pods = get("pods", selector=f"{ENGINE_SELECTOR},app.kubernetes.io/instance={model},"
                                "serving.kubeinfer.io/role=active")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def test_kubectl_scale(store):
    with TRANSCRIPT.step("kubectl scale im tiny --replicas=3, then 2"):
        for replicas in (3, 2):
            kubectl("scale", "inferencemodel", "tiny", f"--replicas={replicas}")
            wait_until(f"tiny at {replicas} ready replicas",
                       lambda: get("inferencemodel", "tiny")["status"].get("readyReplicas") == replicas
                       and len(active_pods("tiny")) == replicas, 300, every=2, seen=lambda: model_state("tiny"))


def test_failover_of_an_active_pod_fails_no_request(store, gateway):
    results: list[int | str] = []
    stop = threading.Event()

    def load():
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                try:
                    r = client.post(f"{gateway.url}/v1/completions",
                                    json={"model": "tiny", "prompt": "Hi", "max_tokens": 4})
                    results.append(r.status_code)
                except httpx.HTTPError as exc:
                    results.append(type(exc).__name__)

    with TRANSCRIPT.step("delete an active pod under load"):
        served(gateway, "tiny")
        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        time.sleep(3)
        victim = active_pods("tiny")[0]["metadata"]["name"]
        kubectl("delete", "pod", victim, "--wait=false")
        wait_until("tiny back at 2 ready active pods", lambda: len(active_pods("tiny")) == 2 and victim not in
                   [p["metadata"]["name"] for p in active_pods("tiny")]
                   and get("inferencemodel", "tiny")["status"].get("readyReplicas") == 2, 180, every=1,
                   seen=lambda: model_state("tiny"))
        time.sleep(5)
        stop.set()
        worker.join(90)
        failed = [r for r in results if r != 200]
        TRANSCRIPT.add("  requests during failover", 0.0, f"{len(failed)} of {len(results)} failed")
        assert results and not failed, f"{len(failed)} of {len(results)} failed: {sorted(set(map(str, failed)))}"


def test_scale_to_zero_then_a_request_wakes_the_model(store, gateway):
    with TRANSCRIPT.step("scale to zero (minReplicas 0): ScaledToZero, standby kept"):
        kubectl("patch", "inferencemodel", "tiny", "--type=merge", "-p",
                json.dumps({"spec": {"minReplicas": 0, "replicas": 0}}))
        wait_until("tiny with no active pod", lambda: not active_pods("tiny")
                   and get("inferencemodel", "tiny")["status"].get("standbyReplicas") == 1, 120, every=1,
                   seen=lambda: model_state("tiny"))
    with TRANSCRIPT.step("a request held at the gateway wakes it"):
        start = time.monotonic()
        r = httpx.post(f"{gateway.url}/v1/completions", timeout=180,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200, r.text[:300]
        TRANSCRIPT.add("  first request after zero", time.monotonic() - start, "200")
        assert get("inferencemodel", "tiny")["spec"]["replicas"] >= 1


def test_adapters_from_the_same_claim_their_own_claim_and_file(store, gateway):
    adapters = [{"name": "sql", "uri": "pvc://models/adapters/sql"}, {"name": "chat", "uri": "pvc://adapters/chat"},
                {"name": "legal", "uri": f"file://{store['host'] / 'legal'}"}]
    with TRANSCRIPT.step("model with 3 adapters Ready (same PVC, own PVC, file://)"):
        kubectl("apply", "-f", "-", input=json.dumps(inference_model("lora", "pvc://models/tiny", adapters=adapters)))
        wait_ready("lora", 360)
    with TRANSCRIPT.step("each adapter served through the gateway"):
        for adapter in ("sql", "chat", "legal"):
            served(gateway, adapter, timeout=180)
        kubectl("delete", "inferencemodel", "lora", "--timeout=120s", timeout=150)


def test_an_hf_model_is_fetched_from_a_hub_stand_in(store, gateway, images):
    with TRANSCRIPT.step("hub stand-in pod (HF file API) Ready"):
        endpoint = hub_standin(f"{images['registry']}/engine:{images['tag']}-cpu")
    with TRANSCRIPT.step("hf:// model fetched by its init container, Ready and served"):
        kubectl("apply", "-f", "-", input=json.dumps(inference_model("fetched", "hf://e2e/tiny",
                                                                      env={"HF_ENDPOINT": endpoint})))
        wait_ready("fetched", 360)
        served(gateway, "fetched")
        kubectl("delete", "inferencemodel", "fetched", "--timeout=120s", timeout=150)


def test_helm_upgrade_then_uninstall_keeps_engines_serving(release, gateway):
    with TRANSCRIPT.step("helm upgrade (gateway setting changed)"):
        helm("upgrade", "kubeinfer", str(ROOT / "charts" / "kubeinfer"), *release,
             "--set", "gateway.upstream.maxAttempts=3", "--wait", "--timeout", "240s", timeout=300)
        gateway.start()
        served(gateway, "tiny")
    with TRANSCRIPT.step("helm uninstall: engine pods keep running"):
        before = {p["metadata"]["name"] for p in active_pods("tiny")}
        helm("uninstall", "kubeinfer", "--namespace", "kubeinfer", "--wait", "--timeout", "120s", timeout=180)
        time.sleep(15)
        after = {p["metadata"]["name"]: p for p in active_pods("tiny")}
        assert before == set(after), f"engine pods changed after uninstall: {before} -> {set(after)}"
        assert all(p["status"]["phase"] == "Running" for p in after.values())
    with TRANSCRIPT.step("helm uninstall: a restarted engine pod starts again"):
        engine_pods = f"{ENGINE_SELECTOR},app.kubernetes.io/instance=tiny"
        existing = {p["metadata"]["name"] for p in get("pods", selector=engine_pods)["items"]}  # standby too
        victim = sorted(after)[0]
        kubectl("delete", "pod", victim, "--wait=false")

        def replaced():
            pods = [p for p in get("pods", selector=engine_pods)["items"] if p["metadata"]["name"] not in existing]
            waiting = [c.get("state", {}).get("waiting", {}).get("reason") for p in pods
                       for c in p.get("status", {}).get("containerStatuses", [])]
            if "CreateContainerConfigError" in waiting:
                raise AssertionError(f"the new engine pod cannot start: {waiting} (the engine key Secret is gone?)")
            return any(c.get("ready") for p in pods for c in p.get("status", {}).get("containerStatuses", []))
        wait_until("a replacement engine pod Ready after helm uninstall", replaced, 180, every=2,
                   seen=lambda: model_state("tiny"))
