"""The real kopf operator against kmock's emulated Kubernetes API: objects, roles, placement, status, events."""
from __future__ import annotations

import kubernetes_validate
import pytest
from operator_harness import Cluster, eventually

from kubeinfer.operator.names import ADAPTERS_ANNOTATION, API_VERSION, PLURAL, ROLE_LABEL

K8S_VERSION = "1.34.0"
SPEC = {"model": {"uri": "pvc://models/tiny"}, "replicas": 2, "standby": {"replicas": 1},
        "adapters": [{"name": n, "uri": f"pvc://loras/{n}"} for n in ("a", "b", "c")],
        "adapterPool": {"maxLorasPerReplica": 2, "replicasPerAdapter": 1}}


def roles(pods) -> dict[str, str | None]:
    return {p["metadata"]["name"]: p["metadata"].get("labels", {}).get(ROLE_LABEL) for p in pods}


def adapters(pods) -> dict[str, str | None]:
    return {p["metadata"]["name"]: p["metadata"].get("annotations", {}).get(ADAPTERS_ANNOTATION) for p in pods}


def condition(model, kind: str) -> dict:
    return next((c for c in (model.get("status") or {}).get("conditions", []) if c["type"] == kind), {})


async def serving(cluster: Cluster, name: str, spec: dict) -> list[str]:
    """Create a model, let the 'Deployment controller' make its pods and the 'kubelet' ready them."""
    await cluster.create_model(name, spec)
    await eventually(lambda: cluster.get("apps/v1", "deployments", name))
    pods = await cluster.sync_pods(name)
    for pod in pods:
        await cluster.set_ready(pod, True)

    async def all_ready():
        model = await cluster.model(name)
        return condition(model, "Progressing").get("reason") == "Complete"
    await eventually(all_ready)
    return pods


async def test_apply_builds_owned_objects_and_status():
    async with Cluster() as cluster:
        created = await cluster.create_model("m1", SPEC)
        uid = created["metadata"]["uid"]
        deployment = await eventually(lambda: cluster.get("apps/v1", "deployments", "m1"))
        service = await eventually(lambda: cluster.get("v1", "services", "m1"))
        pdb = await eventually(lambda: cluster.get("policy/v1", "poddisruptionbudgets", "m1"))
        pool = await eventually(lambda: cluster.get("inference.networking.k8s.io/v1", "inferencepools", "m1"))
        assert deployment["spec"]["replicas"] == 3  # replicas + standby
        assert service["spec"]["selector"][ROLE_LABEL] == "active"
        assert pool["spec"]["selector"]["matchLabels"][ROLE_LABEL] == "active"
        assert pdb["spec"]["minAvailable"] == 2
        for obj in (deployment, service, pdb, pool):
            ref, = obj["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("InferenceModel", "m1", uid, True)
        for obj in (deployment, service, pdb):  # what the operator stored is what Kubernetes accepts
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        model = await eventually(lambda: _with_condition(cluster, "m1", "Ready"))
        assert condition(model, "Ready")["status"] == "False"
        assert model["status"]["observedGeneration"] == 1
        assert not model["metadata"].get("finalizers")  # deletion is left to the garbage collector

        pods = await cluster.sync_pods("m1")
        got = await eventually(lambda: _all_labelled(cluster, "m1", 3))
        assert sorted(got.values()) == ["active", "active", "standby"]
        assert got[pods[2]] == "standby"  # the youngest pod waits
        for pod in pods:
            await cluster.set_ready(pod, True)

        async def complete():
            m = await cluster.model("m1")
            return condition(m, "Progressing").get("reason") == "Complete" and m
        model = await eventually(complete)
        assert model["status"]["readyReplicas"] == 2 and model["status"]["standbyReplicas"] == 1
        assert condition(model, "Ready")["status"] == "True" and condition(model, "Degraded")["status"] == "False"
        assert condition(model, "AdaptersPlaced")["status"] == "True"
        placed = adapters(await cluster.pods("m1"))
        assert placed[pods[2]] in (None, "")  # standby holds no adapter
        held = [a for p in pods[:2] for a in (placed[p] or "").split(",") if a]
        assert sorted(held) == ["a", "b", "c"] and all(len((placed[p] or "").split(",")) <= 2 for p in pods[:2])
        assert sorted(a["name"] for a in model["status"]["adapters"]) == ["a", "b", "c"]


async def _with_condition(cluster: Cluster, name: str, kind: str):
    model = await cluster.model(name)
    return model if condition(model, kind) else None


async def _all_labelled(cluster: Cluster, name: str, count: int):
    got = roles(await cluster.pods(name))
    return got if len(got) == count and all(got.values()) else None


async def test_unready_active_pod_is_replaced_by_ready_standby():
    async with Cluster() as cluster:
        pods = await serving(cluster, "m2", SPEC)
        before = roles(await cluster.pods("m2"))
        standby = next(p for p, r in before.items() if r == "standby")
        victim = next(p for p, r in before.items() if r == "active")
        survivor = next(p for p, r in before.items() if r == "active" and p != victim)
        survivor_adapters = adapters(await cluster.pods("m2"))[survivor]
        await cluster.set_ready(victim, False)

        async def swapped():
            now = roles(await cluster.pods("m2"))
            return now[standby] == "active" and now[victim] == "standby" and now
        await eventually(swapped)
        event, = await eventually(lambda: cluster.events("StandbyPromoted"))
        assert standby in event["message"] and victim in event["message"]
        assert event["involvedObject"]["name"] == "m2"

        async def replaced():  # every adapter is back on a serving pod; the lost pod holds none
            placed = adapters(await cluster.pods("m2"))
            held = [a for p in (standby, survivor) for a in (placed[p] or "").split(",") if a]
            return placed[victim] == "" and sorted(held) == ["a", "b", "c"] and placed
        placed = await eventually(replaced)
        assert set(survivor_adapters.split(",")) <= set(placed[survivor].split(","))  # what serves stays put
        assert len(pods) == 3


async def test_deleted_active_pod_is_replaced_and_standby_restored():
    async with Cluster() as cluster:
        await serving(cluster, "m3", SPEC)
        before = roles(await cluster.pods("m3"))
        standby = next(p for p, r in before.items() if r == "standby")
        victim = next(p for p, r in before.items() if r == "active")
        await cluster.delete_pod(victim)
        await eventually(lambda: _role_is(cluster, "m3", standby, "active"))
        new_pods = await cluster.sync_pods("m3")  # the Deployment replaces the lost pod ...
        fresh = (set(new_pods) - set(before)).pop()
        await eventually(lambda: _role_is(cluster, "m3", fresh, "standby"))  # ... and it becomes the standby
        await cluster.set_ready(fresh, True)

        async def restored():
            m = await cluster.model("m3")
            return m["status"].get("standbyReplicas") == 1 and m["status"].get("readyReplicas") == 2
        await eventually(restored)


async def _role_is(cluster: Cluster, name: str, pod: str, role: str) -> bool:
    return roles(await cluster.pods(name)).get(pod) == role


async def test_spec_changes_are_followed():
    async with Cluster() as cluster:
        await serving(cluster, "m4", SPEC)
        new = {"replicas": 3, "standby": {"replicas": 0},
               "adapters": [{"name": n, "uri": f"pvc://loras/{n}"} for n in ("a", "b", "d")]}
        await cluster.patch_spec("m4", new)

        async def followed():
            d = await cluster.get("apps/v1", "deployments", "m4")
            p = await cluster.get("policy/v1", "poddisruptionbudgets", "m4")
            return d["spec"]["replicas"] == 3 and p["spec"].get("maxUnavailable") == 1 and d
        deployment = await eventually(followed)
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--max-loras") + 1] == "2"
        assert "/adapters/d" in str(deployment["spec"]["template"]["spec"]["containers"][0]["volumeMounts"])

        async def all_active():
            got = roles(await cluster.pods("m4"))
            return sorted(got.values()) == ["active"] * 3 and got
        await eventually(all_active)

        async def placed_new_set():
            held = [a for v in adapters(await cluster.pods("m4")).values() for a in (v or "").split(",") if a]
            return sorted(held) == ["a", "b", "d"]
        await eventually(placed_new_set)
        model = await eventually(lambda: _observed(cluster, "m4", 2))
        assert sorted(a["name"] for a in model["status"]["adapters"]) == ["a", "b", "d"]


async def _observed(cluster: Cluster, name: str, generation: int):
    model = await cluster.model(name)
    return model if model["status"].get("observedGeneration") == generation else None


async def test_invalid_spec_builds_nothing_and_says_why():
    async with Cluster() as cluster:
        bad = {**SPEC, "engine": {"args": ["--port", "9000"]}}
        await cluster.create_model("bad", bad)

        async def refused():
            c = condition(await cluster.model("bad"), "Ready")
            return c.get("reason") == "InvalidSpec" and c
        ready = await eventually(refused)
        assert ready["status"] == "False" and "--port" in ready["message"]
        # kopf posts events in the background: the condition may land first.
        assert (await eventually(lambda: cluster.events("InvalidSpec")))[0]["type"] == "Warning"
        for api_version, plural in (("apps/v1", "deployments"), ("v1", "services"),
                                    ("policy/v1", "poddisruptionbudgets")):
            assert await cluster.get(api_version, plural, "bad") is None
        await cluster.patch_spec("bad", {"engine": {"args": []}})
        await eventually(lambda: cluster.get("apps/v1", "deployments", "bad"))


async def test_no_inference_pool_when_its_crd_is_missing():
    async with Cluster(with_pools=False) as cluster:
        await cluster.create_model("m5", SPEC)
        await eventually(lambda: cluster.get("policy/v1", "poddisruptionbudgets", "m5"))
        # kmock stores whatever is POSTed, declared or not: no stored pool means none was sent.
        assert [key for key in cluster.k8s.objects if key[0].plural == "inferencepools"] == []
        assert await cluster.get("apps/v1", "deployments", "m5") is not None


async def test_delete_removes_the_model_without_waiting_on_a_finalizer():
    async with Cluster() as cluster:
        created = await cluster.create_model("m6", SPEC)
        await eventually(lambda: cluster.get("apps/v1", "deployments", "m6"))
        await eventually(lambda: ("default", "m6") in cluster.reconciler.states)
        await cluster.delete_model("m6")
        await eventually(lambda: _gone(cluster, "m6"))
        await eventually(lambda: ("default", "m6") not in cluster.reconciler.states)
        # kmock has no garbage collector: check the owner references it would follow.
        for api_version, plural in (("apps/v1", "deployments"), ("v1", "services"),
                                    ("policy/v1", "poddisruptionbudgets"),
                                    ("inference.networking.k8s.io/v1", "inferencepools")):
            ref, = (await cluster.get(api_version, plural, "m6"))["metadata"]["ownerReferences"]
            assert ref["uid"] == created["metadata"]["uid"] and ref["blockOwnerDeletion"] is True


async def _gone(cluster: Cluster, name: str) -> bool:
    return await cluster.model(name) is None


@pytest.mark.parametrize("depth", [10.0])
async def test_autoscaling_promotes_standby_then_scales_down_after_delay(depth):
    async with Cluster(resync_seconds=0.3) as cluster:
        spec = {**SPEC, "adapters": [], "replicas": 1, "minReplicas": 1, "maxReplicas": 3,
                "standby": {"replicas": 1}, "autoscaling": {"targetQueueDepth": 2, "scaleDownDelaySeconds": 1}}
        await serving(cluster, "auto", spec)
        standby = next(p for p, r in roles(await cluster.pods("auto")).items() if r == "standby")
        cluster.metrics.every = depth
        await eventually(lambda: _spec_replicas(cluster, "auto", 3))
        await eventually(lambda: _role_is(cluster, "auto", standby, "active"))  # no new pod needed to scale up
        assert (await eventually(lambda: cluster.events("Autoscaled")))[0]["message"].startswith("spec.replicas 1 -> 3")
        deployment = await eventually(lambda: _deployment_replicas(cluster, "auto", 4))
        assert deployment
        cluster.metrics.every = 0.0
        await eventually(lambda: _spec_replicas(cluster, "auto", 1), timeout=20)

        async def scaled_down_in_steps():
            seen = [e["message"].split(":")[0] for e in await cluster.events("Autoscaled")]
            return "spec.replicas 3 -> 2" in seen and "spec.replicas 2 -> 1" in seen
        await eventually(scaled_down_in_steps)


async def _spec_replicas(cluster: Cluster, name: str, n: int) -> bool:
    return (await cluster.model(name))["spec"]["replicas"] == n


async def _deployment_replicas(cluster: Cluster, name: str, n: int):
    d = await cluster.get("apps/v1", "deployments", name)
    return d if d["spec"]["replicas"] == n else None



async def test_cli_runs_the_operator_from_a_kubeconfig_and_stops_on_sigterm(tmp_path):
    """`python -m kubeinfer.operator.cli` as a process: KUBECONFIG login, reconcile, clean exit on SIGTERM."""
    import asyncio
    import os
    import signal
    import sys

    import yaml

    async with Cluster(operator=False) as cluster:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": cluster.url}}],
            "users": [{"name": "nobody", "user": {"token": "unused"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "nobody"}}]}))
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kubeinfer.operator.cli", "--health-port", "0", "--resync-seconds", "1",
            "--engine-image", "registry.local/engine:test", env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            await cluster.create_model("cli", SPEC)
            deployment = await eventually(lambda: cluster.get("apps/v1", "deployments", "cli"), timeout=30)
            assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.local/engine:test"
        finally:
            process.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 0, stderr.decode()[-2000:]


@pytest.mark.parametrize("with_kubernetes_client", [True, False])
async def test_default_login_reads_kubeconfig(tmp_path, monkeypatch, with_kubernetes_client):
    """KUBECONFIG works with the optional `kubernetes` package (which reads its default path at import
    time, so here it fails and the next method is tried) and without it (kopf's own reader)."""
    import sys

    import yaml

    from kubeinfer.operator.handlers import connect_default

    if not with_kubernetes_client:
        monkeypatch.setitem(sys.modules, "kubernetes", None)  # makes `import kubernetes` fail
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://10.0.0.1:6443", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "s3cret"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": "ml"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    info = await connect_default()
    assert info.server.rstrip("/") == "https://10.0.0.1:6443"
    assert info.as_http_headers()["Authorization"].endswith("s3cret")


async def test_an_idle_model_scales_to_zero_keeps_its_standby_warm_and_comes_back_through_scale():
    """minReplicas 0: idle for scaleDownDelaySeconds, the active replicas go to 0 (Ready=False, reason
    ScaledToZero, not an error) while the standby stays warm; /scale to 1 promotes the standby (no load)."""
    async with Cluster(resync_seconds=0.3) as cluster:
        spec = {**SPEC, "adapters": [], "replicas": 1, "minReplicas": 0, "maxReplicas": 2,
                "standby": {"replicas": 1}, "autoscaling": {"targetQueueDepth": 2, "scaleDownDelaySeconds": 1}}
        await serving(cluster, "idle", spec)
        cluster.metrics.every = 0.0
        await eventually(lambda: _spec_replicas(cluster, "idle", 0), timeout=20)
        events = [e["message"] for e in await cluster.events("Autoscaled")]
        assert any("scaled to zero" in m for m in events)

        async def scaled_to_zero():
            model = await cluster.model("idle")
            ready = next((c for c in (model.get("status") or {}).get("conditions", []) if c["type"] == "Ready"), {})
            return ready.get("reason") == "ScaledToZero" and ready.get("status") == "False"
        await eventually(scaled_to_zero)
        assert set(roles(await cluster.pods("idle")).values()) == {"standby"}  # warm, unrouted
        warm = next(iter(roles(await cluster.pods("idle"))))
        await cluster.api.patch(API_VERSION, PLURAL, "default", "idle", {"spec": {"replicas": 1}}, "scale")
        await eventually(lambda: _role_is(cluster, "idle", warm, "active"))  # the standby serves: no model load


async def test_the_gateway_asks_for_capacity_once_and_the_operator_promotes_the_warm_standby():
    """A model at zero with a warm standby: the gateway's ScaleUp sets /scale from 0 to max(1, minReplicas)
    and the operator relabels the standby active; more requests held ask for more, up to maxReplicas,
    and replicas only ever go up."""
    from kubernetes import client as k8s_client

    from kubeinfer.gateway.flowcontrol.model_priorities import scale_targets_of
    from kubeinfer.gateway.flowcontrol.scale_up import ScaleUp

    async with Cluster(resync_seconds=0.3) as cluster:
        spec = {**SPEC, "adapters": [], "replicas": 0, "minReplicas": 0, "maxReplicas": 2, "standby": {"replicas": 1},
                "autoscaling": {"targetQueueDepth": 2, "scaleDownDelaySeconds": 60}}
        await serving(cluster, "zero", spec)
        warm = next(iter(roles(await cluster.pods("zero"))))
        models = [await cluster.model("zero")]
        scale_up = ScaleUp(scale_targets_of(models), k8s_client.ApiClient(k8s_client.Configuration(host=cluster.url)))
        assert scale_up.knows(models[0]["spec"]["model"].get("servedName") or "zero")
        name = next(iter(scale_up.targets))
        assert await scale_up(name) is True
        assert await scale_up(name) is False  # already on its way: asked once
        assert await scale_up("not-a-model") is False
        await eventually(lambda: _spec_replicas(cluster, "zero", 1))
        await eventually(lambda: _role_is(cluster, "zero", warm, "active"))
        assert await scale_up(name, held=4) is True  # a bigger hold: 4 held / targetQueueDepth 2
        await eventually(lambda: _spec_replicas(cluster, "zero", 2))
        assert await scale_up(name, held=40) is False  # never beyond maxReplicas
