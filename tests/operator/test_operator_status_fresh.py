"""Conditions describe the pods the model runs now (issue #46, defects 5 and 7).

7: after a spec fix the old ReplicaSet's pod lingers (Pending, Unschedulable) while the new one fails: the
status quotes the new pod, not the old. 5: a condition message carries no terminal escape codes, wherever in
the pod's status they came from.
"""
from __future__ import annotations

import uuid

from operator_harness import Cluster, eventually

from kubeinfer.operator.builders import desired_objects
from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.names import TEMPLATE_ANNOTATION
from kubeinfer.operator.pods import pod_view
from kubeinfer.operator.roles import assign_roles
from kubeinfer.operator.spec import parse_spec
from kubeinfer.operator.status import conditions_for
from kubeinfer.operator.template_hash import current_template

SPEC = {"model": {"uri": "pvc://models/tiny"}, "replicas": 1}
UNSCHEDULABLE = {"phase": "Pending", "conditions": [
    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
     "message": "0/1 nodes are available: 1 Insufficient cpu."}]}
FETCH_CRASHING = {"phase": "Pending", "initContainerStatuses": [{
    "name": "fetch-model", "ready": False, "restartCount": 3,
    "state": {"waiting": {"reason": "CrashLoopBackOff",
                          "message": "back-off 40s restarting failed container=fetch-model \x1b[31mred\x1b[0m"}},
    "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                 "message": "\x1b[1m\x1b[31mError:\x1b[0m offline mode is enabled."}}}]}


def template_of(spec: dict) -> str:
    objects = desired_objects({"metadata": {"name": "m", "namespace": "ns", "uid": "u"}},
                              parse_spec("m", spec), OperatorConfig(), with_pool=False)
    return current_template(next(o for o in objects if o["kind"] == "Deployment"))


def pod(name: str, template: str, status: dict, created: str) -> dict:
    return {"metadata": {"name": name, "creationTimestamp": created, "annotations": {TEMPLATE_ANNOTATION: template}},
            "status": status}


def test_the_template_hash_follows_the_pod_template_only():
    first = template_of(SPEC)
    assert first and template_of(SPEC) == first
    assert template_of({**SPEC, "replicas": 3}) == first  # scaling is no new template: no rollout, same pods
    assert template_of({**SPEC, "engine": {"args": ["--max-num-seqs", "8"]}}) != first


def test_trouble_is_quoted_from_pods_of_the_current_template():
    spec = parse_spec("m", SPEC)
    old, new = template_of(SPEC), template_of({**SPEC, "engine": {"args": ["--max-num-seqs", "8"]}})
    pods = [pod_view(pod("m-old", old, UNSCHEDULABLE, "T1")), pod_view(pod("m-new", new, FETCH_CRASHING, "T2"))]
    got = {c.type: c for c in conditions_for(spec, pods, assign_roles(pods, 1), None, template=new)}
    assert got["Degraded"].reason == "EngineCrashLoop" and "m-new" in got["Degraded"].message
    assert "m-old" not in got["Degraded"].message and "Unschedulable" not in got["Ready"].reason
    # the old pod's trouble is history: alone, it is no reason for Degraded
    alone = {c.type: c for c in conditions_for(spec, pods[:1], assign_roles(pods[:1], 1), None, template=new)}
    assert alone["Degraded"].status is False and alone["Ready"].reason == "ModelLoading"


def test_condition_messages_carry_no_terminal_escape_codes():
    spec = parse_spec("m", SPEC)
    pods = [pod_view(pod("m-new", "t", FETCH_CRASHING, "T1"))]
    for condition in conditions_for(spec, pods, assign_roles(pods, 1), None):
        assert "\x1b" not in condition.message, condition
    assert "offline mode is enabled" in pods[0].stuck and "red" in pods[0].stuck


async def test_after_a_spec_fix_the_status_describes_the_new_replica_sets_pod():
    async with Cluster() as cluster:
        await cluster.create_model("m7", SPEC)
        await eventually(lambda: cluster.get("apps/v1", "deployments", "m7"))
        old, = await cluster.sync_pods("m7")
        await cluster.api.patch("v1", "pods", cluster.namespace, old, {"status": UNSCHEDULABLE})

        async def reason(wanted: str, generation: int):
            model = await cluster.model("m7")
            status = model.get("status") or {}
            degraded = next((c for c in status.get("conditions", []) if c["type"] == "Degraded"), {})
            return degraded if status.get("observedGeneration") == generation and degraded.get(
                "reason") == wanted else None
        await eventually(lambda: reason("Unschedulable", 1))

        await cluster.patch_spec("m7", {"engine": {"args": ["--max-num-seqs", "8"]}})

        async def rolled():
            d = await cluster.get("apps/v1", "deployments", "m7")
            return d if "--max-num-seqs" in d["spec"]["template"]["spec"]["containers"][0]["args"] else None
        template = (await eventually(rolled))["spec"]["template"]
        # the new ReplicaSet's pod (maxSurge 1): its fetch fails, the old pod stays Pending beside it
        await cluster.api.request("POST", f"/api/v1/namespaces/{cluster.namespace}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "m7-new", "namespace": cluster.namespace, "uid": str(uuid.uuid4()),
                         "creationTimestamp": "2027-01-01T00:00:00Z",
                         **{k: dict(v) for k, v in template["metadata"].items()}},
            "spec": template["spec"], "status": FETCH_CRASHING})
        degraded = await eventually(lambda: reason("EngineCrashLoop", 2))
        assert "m7-new" in degraded["message"] and old not in degraded["message"]
        assert "\x1b" not in degraded["message"]
