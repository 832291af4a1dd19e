"""The operator under faults, against kmock: owned objects deleted or edited by hand, replicas written
by someone else at the same time, the API server refusing (403, 422) or failing (409, 5xx), and an
adapter that does not load on one pod. Each test fails on the behaviour issue #16 describes."""
from __future__ import annotations

import asyncio
import logging

import pytest
from operator_harness import Cluster, FakeQueueDepths, eventually
from test_operator_kmock import SPEC, condition, serving

from kubeinfer.operator.kube import api_path
from kubeinfer.operator.names import API_VERSION, PLURAL, ROLE_LABEL

POOLS = "inference.networking.k8s.io/v1"
OWNED = [("apps/v1", "deployments"), ("v1", "services"), ("policy/v1", "poddisruptionbudgets"), (POOLS, "inferencepools")]
OWNED_PLURALS = {plural for _, plural in OWNED}


def owned_writes(cluster: Cluster) -> int:
    return sum(n for (_, plural), n in cluster.k8s.writes.items() if plural.split("/")[0] in OWNED_PLURALS)


# -- drift ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("api_version,plural", OWNED)
async def test_a_deleted_owned_object_is_back_within_seconds(api_version, plural):
    async with Cluster(resync_seconds=300) as cluster:  # the resync timer cannot be what repairs it
        await serving(cluster, "d1", SPEC)
        await cluster.api.request("DELETE", api_path(api_version, plural, "default", "d1"))
        start = asyncio.get_running_loop().time()
        back = await eventually(lambda: cluster.get(api_version, plural, "d1"), timeout=5)
        assert asyncio.get_running_loop().time() - start < 5
        assert back["metadata"]["ownerReferences"][0]["name"] == "d1"
        assert any(plural[:-1] in e["message"].lower() for e in await cluster.events("DriftRepaired"))


async def test_hand_edits_of_owned_objects_are_undone_within_seconds():
    async with Cluster(resync_seconds=300) as cluster:
        await serving(cluster, "d2", SPEC)
        await cluster.api.patch("apps/v1", "deployments", "default", "d2", {"spec": {"replicas": 7}})
        await cluster.api.patch("v1", "services", "default", "d2", {"spec": {"selector": {ROLE_LABEL: "standby"}}})

        async def repaired():
            deployment = await cluster.get("apps/v1", "deployments", "d2")
            service = await cluster.get("v1", "services", "d2")
            return deployment["spec"]["replicas"] == 3 and service["spec"]["selector"][ROLE_LABEL] == "active"
        await eventually(repaired, timeout=5)


async def test_owned_object_events_without_drift_cause_no_writes():
    async with Cluster(resync_seconds=300) as cluster:
        await serving(cluster, "d3", SPEC)
        state = cluster.reconciler.states[("default", "d3")]
        await eventually(lambda: not state.suspects and not state.lock.locked())
        before = owned_writes(cluster)
        # What others do all the time: the Deployment controller writes status, a user annotates.
        await cluster.api.patch("apps/v1", "deployments", "default", "d3", {"status": {"readyReplicas": 3}}, "status")
        await cluster.api.patch("v1", "services", "default", "d3", {"metadata": {"annotations": {"team": "ml"}}})

        def seen():
            deployment, svc = state.observed.get("Deployment") or {}, state.observed.get("Service") or {}
            return (deployment.get("status") or {}).get("readyReplicas") == 3 and \
                (svc["metadata"].get("annotations") or {}).get("team") == "ml" and not state.suspects
        await eventually(seen, timeout=5)
        await asyncio.sleep(0.5)  # room for a wrong re-apply to land
        assert owned_writes(cluster) - before == 2, cluster.k8s.writes  # only the two writes above


# -- replicas through /scale ---------------------------------------------------------------------------
async def test_scale_subresource_sets_replicas():
    async with Cluster() as cluster:
        await serving(cluster, "s1", SPEC)
        scale_path = api_path(API_VERSION, PLURAL, "default", "s1", "scale")
        await cluster.api.request("PATCH", scale_path, {"spec": {"replicas": 3}}, "application/merge-patch+json")

        async def followed():
            deployment = await cluster.get("apps/v1", "deployments", "s1")
            return deployment["spec"]["replicas"] == 4  # 3 active + 1 standby
        await eventually(followed)


class EditDuringScrape(FakeQueueDepths):
    """Someone (kubectl scale, GitOps) sets spec.replicas while the autoscaler reads the queues."""

    def __init__(self) -> None:
        super().__init__()
        self.cluster: Cluster | None = None
        self.edited = False

    async def queue_depths(self, pods) -> dict[str, float]:
        if self.every is None:
            return {}
        if not self.edited:
            self.edited = True
            await self.cluster.reconciler.client.patch(API_VERSION, PLURAL, "default", "auto", {"spec": {"replicas": 2}})
            return {p.name: 10.0 for p in pods}  # the autoscaler would want maxReplicas (3)
        return {p.name: 2.0 for p in pods}  # on target: no change from whatever spec.replicas is


async def test_autoscaler_never_overwrites_a_concurrent_replica_edit():
    metrics = EditDuringScrape()
    async with Cluster(resync_seconds=0.2, metrics=metrics) as cluster:
        metrics.cluster = cluster
        spec = {**SPEC, "adapters": [], "replicas": 1, "minReplicas": 1, "maxReplicas": 3,
                "autoscaling": {"targetQueueDepth": 2, "scaleDownDelaySeconds": 60}}
        await serving(cluster, "auto", spec)
        metrics.every = 10.0
        await eventually(lambda: metrics.edited)
        await eventually(lambda: cluster.k8s.conflicts > 0)  # the stale write was refused ...
        await asyncio.sleep(1.0)  # ... and several resyncs later, the edit still stands
        assert (await cluster.model("auto"))["spec"]["replicas"] == 2
        assert not [e for e in await cluster.events("Autoscaled") if "-> 3" in e["message"]]


# -- error classes -------------------------------------------------------------------------------------
FORBIDDEN_MESSAGE = ('poddisruptionbudgets.policy "e1" is forbidden: User "system:serviceaccount:kubeinfer:'
                     'kubeinfer-operator" cannot patch resource "poddisruptionbudgets" in API group "policy" in the '
                     'namespace "default"')


async def test_forbidden_is_degraded_naming_verb_and_resource_logged_once(caplog):
    caplog.set_level(logging.DEBUG, logger="kubeinfer.operator")
    async with Cluster(resync_seconds=0.2) as cluster:
        cluster.k8s.refuse("PATCH", "poddisruptionbudgets", 403, FORBIDDEN_MESSAGE)
        await cluster.create_model("e1", SPEC)

        async def degraded():
            c = condition(await cluster.model("e1"), "Degraded")
            return c.get("reason") == "Forbidden" and c
        cond = await eventually(degraded)
        assert cond["status"] == "True"
        assert "patch poddisruptionbudgets (API group 'policy') in namespace default" in cond["message"]
        assert "cannot patch resource" in cond["message"]  # the server's words too
        model = await cluster.model("e1")
        assert condition(model, "Ready").get("reason") != "InvalidSpec"
        await asyncio.sleep(1.0)  # several resync passes meet the same 403
        lines = [r for r in caplog.records if r.levelno >= logging.WARNING and "not allowed" in r.getMessage()]
        assert len(lines) == 1 and not lines[0].exc_info, [r.getMessage() for r in lines]
        assert len(await cluster.events("Forbidden")) == 1

        cluster.k8s.allow()  # the admin grants it: the next resync goes through

        async def recovered():
            c = condition(await cluster.model("e1"), "Degraded")
            return c.get("reason") != "Forbidden" and await cluster.get("policy/v1", "poddisruptionbudgets", "e1")
        await eventually(recovered)


async def test_unprocessable_is_invalid_spec_with_the_servers_message():
    message = 'Deployment.apps "e2" is invalid: spec.template.spec.priorityClassName: Invalid value: "gold": no such class'
    async with Cluster() as cluster:
        cluster.k8s.refuse("PATCH", "deployments", 422, message)
        await cluster.create_model("e2", SPEC)

        async def invalid():
            c = condition(await cluster.model("e2"), "Ready")
            return c.get("reason") == "InvalidSpec" and c
        ready = await eventually(invalid)
        assert message in ready["message"] and "patch deployments" in ready["message"]
        assert condition(await cluster.model("e2"), "Degraded")["reason"] == "InvalidSpec"


@pytest.mark.parametrize("code", [409, 500, 503])
async def test_conflicts_and_server_errors_are_retried_with_backoff(code):
    async with Cluster(resync_seconds=300) as cluster:  # only the backoff can bring the retry in time
        cluster.k8s.refuse("PATCH", "deployments", code, "try again", times=3)
        await cluster.create_model("e3", SPEC)

        async def retrying():
            c = condition(await cluster.model("e3"), "Progressing")
            return c.get("reason") == "Retrying" and c
        cond = await eventually(retrying)
        assert cond["status"] == "True" and f"HTTP {code}" in cond["message"]
        await eventually(lambda: cluster.get("apps/v1", "deployments", "e3"), timeout=10)  # 0.5 + 1 + 2 s of backoff

        async def settled():
            m = await cluster.model("e3")
            return condition(m, "Progressing").get("reason") != "Retrying" and condition(m, "Degraded").get(
                "status") == "False"
        await eventually(settled)


# -- observed adapters ---------------------------------------------------------------------------------
ADAPTER_SPEC = {**SPEC, "adapters": [{"name": n, "uri": f"pvc://loras/{n}"} for n in ("a", "b")],
                "adapterPool": {"maxLorasPerReplica": 2, "replicasPerAdapter": 2}}


async def test_adapter_that_fails_to_load_on_one_pod_is_reported():
    async with Cluster() as cluster:
        await cluster.create_model("lo", ADAPTER_SPEC)
        await eventually(lambda: cluster.get("apps/v1", "deployments", "lo"))
        pods = await cluster.sync_pods("lo")
        active = pods[:2]  # the two oldest pods become active
        cluster.engines.failing = {(active[1], "b")}
        for pod in pods:
            await cluster.set_ready(pod, True)

        async def not_loaded():
            m = await cluster.model("lo")
            return condition(m, "AdaptersPlaced").get("reason") == "NotLoaded" and m
        model = await eventually(not_loaded)
        cond = condition(model, "AdaptersPlaced")
        assert cond["status"] == "False" and f"b on {active[1]}" in cond["message"]
        entries = {a["name"]: a for a in model["status"]["adapters"]}
        assert entries["b"]["pods"] == active and entries["b"]["loadedPods"] == [active[0]]
        assert entries["a"]["loadedPods"] == active

        cluster.engines.failing = set()  # the load goes through (e.g. the file appeared): seen on the re-check

        async def placed():
            m = await cluster.model("lo")
            return condition(m, "AdaptersPlaced").get("status") == "True" and m
        model = await eventually(placed, timeout=10)
        assert {a["name"]: a["loadedPods"] for a in model["status"]["adapters"]} == {"a": active, "b": active}
