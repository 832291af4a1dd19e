"""The real kopf operator on kmock with tensor parallelism: `gpus: 4` (one Deployment, four ranks per pod),
`nodes: 2` (a LeaderWorkerSet whose groups are the replicas; the LeaderWorkerSet controller is played here),
the same without the LeaderWorkerSet CRD (LeaderWorkerSetMissing), a crash-looping engine's own words in
the model's conditions, and a model moving from one node to two."""
from __future__ import annotations

import base64

import kubernetes_validate
from operator_harness import Cluster, _stamp, eventually
from parallel_helpers import LWS_RESOURCE, group_pods, lws_problems, serve_parser

from kubeinfer.operator.leader_worker import LWS_API_VERSION, LWS_PLURAL
from kubeinfer.operator.names import ADAPTERS_ANNOTATION, ROLE_LABEL

K8S_VERSION = "1.34.0"
FOUR_GPUS = {"model": {"uri": "pvc://models/llama-70b"}, "engine": {"resources": {"gpus": 4}}}
TWO_NODES = {"model": {"uri": "pvc://models/llama-405b"}, "replicas": 1, "standby": {"replicas": 1},
             "engine": {"resources": {"gpus": 8}, "parallelism": {"nodes": 2}},
             "adapters": [{"name": "sql", "uri": "pvc://loras/sql"}]}
HEADS = "kubeinfer serve: the model has 14 attention heads, which --tensor-parallel-size 4 does not divide"


def condition(model: dict, kind: str) -> dict:
    return next((c for c in (model.get("status") or {}).get("conditions", []) if c["type"] == kind), {})


async def reason_is(cluster: Cluster, name: str, kind: str, reason: str) -> dict | None:
    model = await cluster.model(name)
    return model if condition(model, kind).get("reason") == reason else None


async def run_groups(cluster: Cluster, name: str) -> list[dict]:
    """Play the LeaderWorkerSet controller once: every group's pods, as it names, labels and configures them."""
    lws = await eventually(lambda: cluster.get(LWS_API_VERSION, LWS_PLURAL, f"{name}-lws"))
    pods = group_pods(lws, cluster.namespace, _stamp)
    existing = {p["metadata"]["name"] for p in await cluster.pods(name)}
    for pod in pods:
        if pod["metadata"]["name"] not in existing:
            await cluster.api.request("POST", f"/api/v1/namespaces/{cluster.namespace}/pods", pod)
    return pods


def roles(pods: list[dict]) -> dict[str, str | None]:
    return {p["metadata"]["name"]: (p["metadata"].get("labels") or {}).get(ROLE_LABEL) for p in pods}


async def test_four_gpus_serve_as_four_ranks_of_one_pod():
    async with Cluster() as cluster:
        await cluster.create_model("llama", FOUR_GPUS)
        deployment = await eventually(lambda: cluster.get("apps/v1", "deployments", "llama"))
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
        (pod,) = await cluster.sync_pods("llama")
        engine = (await cluster.pods("llama"))[0]["spec"]["containers"][0]
        args = serve_parser().parse_args(engine["args"][1:])
        assert (args.tensor_parallel_size, args.device) == (4, "cuda")
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 4
        await cluster.set_ready(pod, True)
        model = await eventually(lambda: reason_is(cluster, "llama", "Progressing", "Complete"))
        assert model["status"]["readyReplicas"] == 1


async def test_two_nodes_serve_as_leader_worker_groups():
    async with Cluster(resources=LWS_RESOURCE) as cluster:
        await cluster.create_model("llama", TWO_NODES)
        lws = await eventually(lambda: cluster.get(LWS_API_VERSION, LWS_PLURAL, "llama-lws"))
        assert lws_problems(lws) == [] and lws["spec"]["replicas"] == 2  # 1 active + 1 standby group
        assert await cluster.get("apps/v1", "deployments", "llama") is None
        pods = await run_groups(cluster, "llama")
        names = [p["metadata"]["name"] for p in pods]
        assert names == ["llama-lws-0", "llama-lws-0-1", "llama-lws-1", "llama-lws-1-1"]
        for name in names:
            await cluster.set_ready(name, True)
        model = await eventually(lambda: reason_is(cluster, "llama", "Progressing", "Complete"))
        status = model["status"]
        assert (status["replicas"], status["readyReplicas"], status["standbyReplicas"]) == (1, 1, 1)  # groups
        got = roles(await cluster.pods("llama"))
        assert got == {"llama-lws-0": "active", "llama-lws-0-1": "worker", "llama-lws-1": "standby",
                       "llama-lws-1-1": "worker"}
        assert status["adapters"] == [{"name": "sql", "pods": ["llama-lws-0"], "loadedPods": ["llama-lws-0"]}]
        service = await cluster.get("v1", "services", "llama")
        assert service["spec"]["selector"][ROLE_LABEL] == "active"  # so: the active group's leader only

        # A worker of the active group fails: the group cannot serve, the ready standby group takes over.
        await cluster.set_ready("llama-lws-0-1", False)

        async def promoted():
            pods = await cluster.pods("llama")
            placed = {p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(ADAPTERS_ANNOTATION)
                      for p in pods}
            return roles(pods)["llama-lws-1"] == "active" and placed["llama-lws-1"] == "sql" and placed
        placed = await eventually(promoted)
        assert not placed.get("llama-lws-1-1") and not placed.get("llama-lws-0-1"), "workers hold no placement"
        assert (await cluster.events("StandbyPromoted"))

        # /scale counts groups: two active groups are four more pods' worth, i.e. three groups in all.
        await cluster.patch_spec("llama", {"replicas": 2})
        await eventually(lambda: _lws_replicas(cluster, 3))


async def _lws_replicas(cluster: Cluster, want: int) -> bool:
    lws = await cluster.get(LWS_API_VERSION, LWS_PLURAL, "llama-lws")
    return lws["spec"]["replicas"] == want


async def test_without_the_lws_crd_the_model_says_what_to_install():
    async with Cluster() as cluster:
        await cluster.create_model("llama", TWO_NODES)
        model = await eventually(lambda: reason_is(cluster, "llama", "Degraded", "LeaderWorkerSetMissing"))
        degraded = condition(model, "Degraded")
        assert degraded["status"] == "True" and "leaderworkerset.x-k8s.io/v1" in degraded["message"]
        assert "install the LeaderWorkerSet controller" in degraded["message"]
        assert condition(model, "Ready")["reason"] == "LeaderWorkerSetMissing"
        assert await cluster.get("apps/v1", "deployments", "llama") is None, "no single-node stand-in"
        assert (await cluster.events("LeaderWorkerSetMissing"))


async def test_a_crash_looping_engine_says_why_in_the_model():
    async with Cluster() as cluster:
        await cluster.create_model("llama", FOUR_GPUS)
        await eventually(lambda: cluster.get("apps/v1", "deployments", "llama"))
        (pod,) = await cluster.sync_pods("llama")
        await cluster.api.patch("v1", "pods", cluster.namespace, pod, {"status": {"phase": "Running", "containerStatuses": [{
            "name": "engine", "ready": False, "restartCount": 2, "image": "e", "imageID": "", "started": False,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s restarting failed container"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": HEADS}}}]}})
        model = await eventually(lambda: reason_is(cluster, "llama", "Degraded", "EngineCrashLoop"))
        for kind in ("Ready", "Degraded"):
            assert HEADS in condition(model, kind)["message"], condition(model, kind)


async def test_one_node_to_two_keeps_serving_until_a_group_does():
    async with Cluster(resources=LWS_RESOURCE) as cluster:
        single = {**TWO_NODES, "standby": {"replicas": 0}, "engine": {"resources": {"gpus": 8}}}
        await cluster.create_model("llama", single)
        await eventually(lambda: cluster.get("apps/v1", "deployments", "llama"))
        (old,) = await cluster.sync_pods("llama")
        await cluster.set_ready(old, True)
        await eventually(lambda: reason_is(cluster, "llama", "Progressing", "Complete"))

        await cluster.patch_spec("llama", {"engine": {"parallelism": {"nodes": 2}}})
        await run_groups(cluster, "llama")
        await eventually(lambda: cluster.get(LWS_API_VERSION, LWS_PLURAL, "llama-lws"))
        assert await cluster.get("apps/v1", "deployments", "llama"), "the old pod serves until a group is ready"
        assert roles(await cluster.pods("llama"))[old] == "active"
        for name in ("llama-lws-0", "llama-lws-0-1"):
            await cluster.set_ready(name, True)

        async def replaced():
            return await cluster.get("apps/v1", "deployments", "llama") is None
        await eventually(replaced)

        async def event_posted():  # the operator deletes first and posts the event after
            return bool(await cluster.events("WorkloadReplaced"))
        await eventually(event_posted)


async def test_installing_the_lws_crd_later_builds_the_model(monkeypatch):
    from kubeinfer.operator import reconcile

    monkeypatch.setattr(reconcile, "CRD_CHECK_SECONDS", 0.0)  # a minute in a cluster
    async with Cluster(resync_seconds=0.3) as cluster:
        await cluster.create_model("llama", TWO_NODES)
        await eventually(lambda: reason_is(cluster, "llama", "Degraded", "LeaderWorkerSetMissing"))
        cluster.k8s.resources.update(LWS_RESOURCE)  # the LWS project is installed
        await eventually(lambda: cluster.get(LWS_API_VERSION, LWS_PLURAL, "llama-lws"))
        for name in [p["metadata"]["name"] for p in await run_groups(cluster, "llama")]:
            await cluster.set_ready(name, True)
        await eventually(lambda: reason_is(cluster, "llama", "Degraded", "AsExpected"))


async def group_policies(cluster: Cluster) -> list[str]:
    found = await cluster.api.list("networking.k8s.io/v1", "networkpolicies", cluster.namespace)
    return sorted(p["metadata"]["name"] for p in found if ".group-" in p["metadata"]["name"])


async def test_the_group_secret_is_made_once_and_each_group_fenced_alone():
    """The model's Secret is created with the LeaderWorkerSet and never rewritten (a new generation, a scale);
    one NetworkPolicy per group (and the surge group), those of groups scaled away deleted."""
    async with Cluster(resources=LWS_RESOURCE) as cluster:
        await cluster.create_model("llama", TWO_NODES)
        await eventually(lambda: cluster.get(LWS_API_VERSION, LWS_PLURAL, "llama-lws"))
        secret = await eventually(lambda: cluster.get("v1", "secrets", "llama-tp-secret"))
        value = base64.b64decode(secret["data"]["secret"])
        assert len(value) == 64 and secret["metadata"]["ownerReferences"][0]["name"] == "llama"
        kubernetes_validate.validate(secret, K8S_VERSION, strict=True)

        async def policies(want: list[str]):
            return await group_policies(cluster) == want or None
        await eventually(lambda: policies(["llama.group-0", "llama.group-1", "llama.group-2"]))
        group0 = await cluster.get("networking.k8s.io/v1", "networkpolicies", "llama.group-0")
        kubernetes_validate.validate(group0, K8S_VERSION, strict=True)
        assert group0["spec"]["podSelector"]["matchLabels"]["leaderworkerset.sigs.k8s.io/group-index"] == "0"

        await cluster.patch_spec("llama", {"replicas": 2})  # a new generation: 3 groups + the surge one
        await eventually(lambda: policies([f"llama.group-{i}" for i in range(4)]))
        await cluster.patch_spec("llama", {"replicas": 1, "standby": {"replicas": 0}})
        await eventually(lambda: policies(["llama.group-0", "llama.group-1"]))
        again = await cluster.get("v1", "secrets", "llama-tp-secret")
        assert base64.b64decode(again["data"]["secret"]) == value, "never rewritten"


async def test_an_existing_group_secret_is_kept():
    async with Cluster(resources=LWS_RESOURCE) as cluster:
        mine = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "llama-tp-secret",
                                                                   "namespace": cluster.namespace},
                "data": {"secret": base64.b64encode(b"b" * 48).decode()}}
        await cluster.api.request("POST", f"/api/v1/namespaces/{cluster.namespace}/secrets", mine)
        await cluster.create_model("llama", TWO_NODES)
        await eventually(lambda: cluster.get(LWS_API_VERSION, LWS_PLURAL, "llama-lws"))
        await eventually(lambda: group_policies(cluster))
        kept = await cluster.get("v1", "secrets", "llama-tp-secret")
        assert base64.b64decode(kept["data"]["secret"]) == b"b" * 48
