"""Issue 34 against the real kopf operator on kmock: a model the policy refuses builds nothing and says why
(finding 10), the second claim on a servedName builds nothing until the first goes (finding 11), and the
NetworkPolicy is built with the model, repaired when deleted, removed when switched off."""
from __future__ import annotations

import kubernetes_validate
from operator_harness import Cluster, eventually

from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.policy import PodPolicy
from kubeinfer.operator.served_names import rivals

BUILT = (("apps/v1", "deployments"), ("v1", "services"), ("policy/v1", "poddisruptionbudgets"),
         ("networking.k8s.io/v1", "networkpolicies"), ("inference.networking.k8s.io/v1", "inferencepools"))
NODE_GRAB = {"model": {"uri": "file:///var/lib/kubelet"},
             "engine": {"image": "docker.io/attacker/miner:1", "priorityClassName": "system-node-critical",
                        "tolerations": [{"operator": "Exists"}],
                        "nodeSelector": {"node-role.kubernetes.io/control-plane": ""}}}


def condition(model: dict, kind: str) -> dict:
    return next((c for c in (model.get("status") or {}).get("conditions", []) if c["type"] == kind), {})


async def refused_for(cluster: Cluster, name: str, reason: str) -> dict:
    async def check():
        model = await cluster.model(name)
        return condition(model, "Ready").get("reason") == reason and model
    return await eventually(check)


async def nothing_built(cluster: Cluster, name: str) -> None:
    for api_version, plural in BUILT:
        assert await cluster.get(api_version, plural, name) is None, plural


async def test_a_model_that_grabs_the_node_builds_nothing_and_names_every_refusal():
    async with Cluster() as cluster:
        await cluster.create_model("grab", NODE_GRAB)
        model = await refused_for(cluster, "grab", "PolicyViolation")
        ready, degraded = condition(model, "Ready"), condition(model, "Degraded")
        assert ready["status"] == "False" and (degraded["status"], degraded["reason"]) == ("True", "PolicyViolation")
        for field in ("spec.model.uri file:///var/lib/kubelet", "spec.engine.image", "spec.engine.priorityClassName",
                      "spec.engine.tolerations[0]", "spec.engine.nodeSelector"):
            assert field in ready["message"], field
        assert (await eventually(lambda: cluster.events("PolicyViolation")))[0]["type"] == "Warning"
        await nothing_built(cluster, "grab")
        await cluster.patch_spec("grab", {"model": {"uri": "pvc://models/tiny"},
                                          "engine": {"image": None, "priorityClassName": None, "tolerations": None,
                                                     "nodeSelector": None}})
        await eventually(lambda: cluster.get("apps/v1", "deployments", "grab"))


async def test_file_uris_under_an_allowed_host_path_are_built():
    config = OperatorConfig(policy=PodPolicy(host_path_prefixes=("/srv/models",)))
    async with Cluster(config=config) as cluster:
        await cluster.create_model("local", {"model": {"uri": "file:///srv/models/tiny"}})
        deployment = await eventually(lambda: cluster.get("apps/v1", "deployments", "local"))
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        assert {"name": "model", "hostPath": {"path": "/srv/models/tiny", "type": "Directory"}} in volumes
        await cluster.create_model("kubelet", {"model": {"uri": "file:///var/lib/kubelet/pods"}})
        model = await refused_for(cluster, "kubelet", "PolicyViolation")
        assert "under /var/lib/kubelet" in condition(model, "Ready")["message"]


async def test_the_second_claim_on_a_served_name_builds_nothing_until_the_first_goes():
    async with Cluster() as cluster:
        await cluster.create_model("first", {"model": {"uri": "pvc://models/a", "servedName": "chat"}})
        await eventually(lambda: cluster.get("apps/v1", "deployments", "first"))
        await cluster.create_model("second", {"model": {"uri": "pvc://models/b", "servedName": "chat"}})
        model = await refused_for(cluster, "second", "ServedNameConflict")
        assert "'chat' is already claimed by InferenceModel first" in condition(model, "Ready")["message"]
        await nothing_built(cluster, "second")
        # A model named like the served name claims it too (servedName defaults to metadata.name).
        await cluster.create_model("chat", {"model": {"uri": "pvc://models/c"}})
        await refused_for(cluster, "chat", "ServedNameConflict")
        await cluster.delete_model("first")
        await eventually(lambda: cluster.get("apps/v1", "deployments", "second"), timeout=20)
        assert condition(await cluster.model("chat"), "Ready").get("reason") == "ServedNameConflict"


def test_the_older_claim_wins_and_a_missing_timestamp_counts_as_oldest():
    def model(name: str, created: str | None, served: str = "chat", deleting: bool = False) -> dict:
        meta = {"name": name, **({"creationTimestamp": created} if created else {}),
                **({"deletionTimestamp": "2026-01-02T00:00:00Z"} if deleting else {})}
        return {"metadata": meta, "spec": {"model": {"servedName": served}}}

    a, b = model("a", "2026-01-01T00:00:02Z"), model("b", "2026-01-01T00:00:01Z")
    untimed, gone, other = model("z", None), model("c", "2026-01-01T00:00:00Z", deleting=True), model("d", None, "x")
    everyone = [a, b, untimed, gone, other]
    assert rivals(a, everyone) == (["z", "b"], [])
    assert rivals(untimed, everyone) == ([], ["b", "a"])
    twins = [model("m1", "2026-01-01T00:00:00Z"), model("m2", "2026-01-01T00:00:00Z")]
    assert rivals(twins[1], twins) == (["m1"], []) and rivals(twins[0], twins) == ([], ["m2"])


async def test_the_network_policy_comes_with_the_model_and_is_repaired():
    async with Cluster() as cluster:
        await cluster.create_model("fenced", {"model": {"uri": "pvc://models/a"}})
        netpol = await eventually(lambda: cluster.get("networking.k8s.io/v1", "networkpolicies", "fenced"))
        kubernetes_validate.validate(netpol, "1.34.0", strict=True)
        await cluster.api.request("DELETE", "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies/fenced")
        await eventually(lambda: cluster.get("networking.k8s.io/v1", "networkpolicies", "fenced"))


async def test_switched_off_the_network_policy_is_removed():
    async with Cluster() as cluster:
        await cluster.create_model("open", {"model": {"uri": "pvc://models/a"}})
        await eventually(lambda: cluster.get("networking.k8s.io/v1", "networkpolicies", "open"))
        # As after a restart with --no-network-policy: the next full pass (a new generation) removes it.
        cluster.reconciler.config = OperatorConfig(network_policy=False, resync_seconds=cluster.resync_seconds)
        await cluster.patch_spec("open", {"replicas": 1})

        async def gone():
            return await cluster.get("networking.k8s.io/v1", "networkpolicies", "open") is None
        await eventually(gone)
        assert await cluster.get("apps/v1", "deployments", "open") is not None
