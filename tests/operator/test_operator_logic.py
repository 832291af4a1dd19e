"""Pure decisions: pod roles (standby promotion), adapter placement, status conditions, autoscaling."""
from __future__ import annotations

import random

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from kubeinfer.operator.autoscale import Autoscaler, HttpQueueDepths, parse_queue_depth, recommend
from kubeinfer.operator.placement import place_adapters
from kubeinfer.operator.pods import PodView, pod_view
from kubeinfer.operator.roles import assign_roles
from kubeinfer.operator.spec import parse_spec
from kubeinfer.operator.status import build_status, conditions_for, render_conditions

SPEC = parse_spec("m", {"model": {"uri": "pvc://m/x"}, "replicas": 2, "standby": {"replicas": 1},
                        "engine": {"resources": {"gpus": 1}}})


def p(name: str, role: str | None = None, ready: bool = False, **kw) -> PodView:
    return PodView(name, role, ready, created=kw.pop("created", name), **kw)


# -- roles ---------------------------------------------------------------------------------------------
def test_first_roles_go_to_the_oldest_pods():
    plan = assign_roles([p("c"), p("a"), p("b")], 2)
    assert plan.roles == {"a": "active", "b": "active", "c": "standby"} and plan.promoted == ()


def test_ready_standby_replaces_an_unready_active_pod():
    pods = [p("a", "active", False), p("b", "active", True), p("c", "standby", True)]
    plan = assign_roles(pods, 2)
    assert plan.roles == {"a": "standby", "b": "active", "c": "active"}
    assert plan.promoted == ("c",) and plan.demoted == ("a",)
    assert plan.changes(pods) == {"a": "standby", "c": "active"}


def test_no_swap_when_the_standby_is_not_ready_either():
    pods = [p("a", "active", False), p("b", "active", True), p("c", "standby", False)]
    assert assign_roles(pods, 2).changes(pods) == {}


def test_lost_active_pod_is_replaced_and_terminating_pods_are_ignored():
    pods = [p("a", "active", True, deleting=True), p("b", "active", True), p("c", "standby", True),
            p("d", None, False)]
    plan = assign_roles(pods, 2)
    assert plan.roles == {"b": "active", "c": "active", "d": "standby"} and plan.promoted == ("c",)


def test_scale_up_promotes_standby_before_any_new_pod():
    pods = [p("a", "active", True), p("b", "standby", True), p("c", None, False)]
    plan = assign_roles(pods, 2)
    assert plan.active() == ["a", "b"] and plan.promoted == ("b",)


def test_scale_down_demotes_the_youngest_and_stays_put_otherwise():
    pods = [p("a", "active", True), p("b", "active", True), p("c", "active", True)]
    assert assign_roles(pods, 2).demoted == ("c",)
    steady = [p("a", "active", True), p("b", "standby", True)]
    assert assign_roles(steady, 1).changes(steady) == {}


def test_unschedulable_pods_are_last_for_activity():
    pods = [p("a", None, False, unschedulable="Insufficient nvidia.com/gpu"), p("b", None, False)]
    assert assign_roles(pods, 1).active() == ["b"]


def test_pod_view_reads_real_pod_status():
    pod = {"metadata": {"name": "m-7d9f-x", "creationTimestamp": "2026-01-01T00:00:00Z",
                        "labels": {"serving.kubeinfer.io/role": "standby"},
                        "annotations": {"serving.kubeinfer.io/adapters": "sql, de"}},
           "status": {"phase": "Pending", "podIP": "10.1.2.3",
                      "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                      "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}],
                      "containerStatuses": [{"name": "engine", "state": {"waiting": {
                          "reason": "CrashLoopBackOff", "message": "back-off 5m0s restarting failed container"}}}]}}
    v = pod_view(pod)
    assert (v.role, v.ready, v.adapters, v.ip) == ("standby", False, ("sql", "de"), "10.1.2.3")
    assert "Insufficient nvidia.com/gpu" in v.unschedulable and v.stuck.startswith("engine: CrashLoopBackOff")
    ready = {"metadata": {"name": "x", "deletionTimestamp": "2026-01-01T00:00:00Z"},
             "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert pod_view(ready).deleting and not pod_view(ready).ready  # a terminating pod serves no new work


# -- placement -----------------------------------------------------------------------------------------
def check_invariants(placement, adapters, pods, r, k):
    for held in placement.assignment.values():
        assert len(held) <= k and len(set(held)) == len(held)
    holders = placement.holders()
    for adapter in adapters:
        assert len(holders.get(adapter, [])) + placement.unplaced.get(adapter, 0) == min(r, len(pods))


def test_placement_spreads_and_respects_limits():
    pl = place_adapters(["a", "b", "c", "d"], ["p1", "p2", "p3"], {}, 2, 3)
    check_invariants(pl, "abcd", ["p1", "p2", "p3"], 2, 3)
    assert pl.unplaced == {} and sorted(len(v) for v in pl.assignment.values()) == [2, 3, 3]


def test_placement_reports_what_does_not_fit():
    pl = place_adapters(["a", "b", "c"], ["p1"], {}, 1, 2)
    assert pl.unplaced == {"c": 1} and pl.assignment == {"p1": ("a", "b")}


@pytest.mark.parametrize("seed", range(40))
def test_fresh_placement_fits_whenever_capacity_allows(seed):
    rng = random.Random(seed)
    pods = [f"p{i}" for i in range(rng.randint(1, 8))]
    adapters = [f"a{i}" for i in range(rng.randint(0, 20))]
    r, k = rng.randint(1, 4), rng.randint(1, 6)
    pl = place_adapters(adapters, pods, {}, r, k)
    check_invariants(pl, adapters, pods, r, k)
    assert (pl.unplaced == {}) == (min(r, len(pods)) * len(adapters) <= len(pods) * k)
    loads = [len(v) for v in pl.assignment.values()]
    assert max(loads) - min(loads) <= 1  # spread evenly


@pytest.mark.parametrize("seed", range(60))
def test_losing_a_pod_moves_only_its_adapters(seed):
    rng = random.Random(seed)
    pods = [f"p{i}" for i in range(rng.randint(2, 8))]
    adapters = [f"a{i}" for i in range(rng.randint(1, 12))]
    r, k = rng.randint(1, 3), rng.randint(2, 6)
    before = place_adapters(adapters, pods, {}, r, k).assignment
    lost = rng.choice(pods)
    survivors = [x for x in pods if x != lost]
    after = place_adapters(adapters, survivors, before, r, k)
    check_invariants(after, adapters, survivors, r, k)
    kept = all(set(before[x]) <= set(after.assignment[x]) for x in survivors)
    if kept:  # sticky: only the lost pod's adapters were placed again, each at most once
        gained = sum(len(set(after.assignment[x]) - set(before[x])) for x in survivors)
        assert gained <= len(before[lost])
    else:  # the one exception: sticking could not fit everything, a fresh placement does
        assert after.unplaced == {} and after.assignment == place_adapters(adapters, survivors, {}, r, k).assignment


def test_new_pod_changes_nothing_when_everything_is_placed():
    before = place_adapters(["a", "b"], ["p1", "p2"], {}, 1, 2).assignment
    after = place_adapters(["a", "b"], ["p1", "p2", "p3"], before, 1, 2)
    assert after.moves(before) == 0 and after.assignment["p3"] == ()


def test_new_pod_takes_the_missing_replicas():
    before = place_adapters(["a", "b"], ["p1"], {}, 2, 4).assignment
    after = place_adapters(["a", "b"], ["p1", "p2"], before, 2, 4)
    assert after.assignment == {"p1": ("a", "b"), "p2": ("a", "b")} and after.moves(before) == 2


def test_removed_adapter_is_unloaded_and_nothing_else_moves():
    before = place_adapters(["a", "b", "c"], ["p1", "p2"], {}, 1, 2).assignment
    after = place_adapters(["a", "c"], ["p1", "p2"], before, 1, 2)
    assert after.moves(before) == 1 and "b" not in str(after.assignment)


def test_shrinking_limits_unloads_from_the_busiest_pods():
    before = {"p1": ("a", "b", "c"), "p2": ("a",)}
    after = place_adapters(["a", "b", "c"], ["p1", "p2"], before, 1, 2)
    check_invariants(after, "abc", ["p1", "p2"], 1, 2)
    assert after.unplaced == {} and after.moves(before) <= 3


# -- status --------------------------------------------------------------------------------------------
def conds(pods, spec=SPEC, placement=None) -> dict[str, tuple[str, str]]:
    plan = assign_roles(pods, spec.replicas)
    return {c.type: (str(c.status), c.reason) for c in conditions_for(spec, pods, plan, placement)}


def test_healthy_model_is_ready_and_complete():
    got = conds([p("a", "active", True), p("b", "active", True), p("c", "standby", True)])
    assert got == {"Ready": ("True", "Serving"), "Progressing": ("False", "Complete"),
                   "Degraded": ("False", "AsExpected"), "AdaptersPlaced": ("True", "NoAdapters")}


def test_loading_model_is_progressing():
    got = conds([p("a"), p("b"), p("c")])
    assert got["Ready"] == ("False", "ModelLoading") and got["Progressing"] == ("True", "Reconciling")
    assert conds([])["Ready"] == ("False", "PodsPending")


def test_no_gpu_capacity_is_named_and_degrades():
    full = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    got = conds([p("a", unschedulable=full), p("b", unschedulable=full), p("c", unschedulable=full)])
    assert got["Ready"] == ("False", "NoGPUCapacity") and got["Degraded"] == ("True", "NoGPUCapacity")
    assert got["Progressing"] == ("False", "Stalled")


def test_standby_that_cannot_be_restored_degrades_a_serving_model():
    got = conds([p("a", "active", True), p("b", "active", True),
                 p("c", unschedulable="0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")])
    assert got["Ready"] == ("True", "Serving") and got["Degraded"] == ("True", "StandbyUnavailable")


def test_crash_looping_engine_is_reported():
    got = conds([p("a", stuck="engine: CrashLoopBackOff: back-off"), p("b"), p("c")])
    assert got["Ready"] == ("False", "EngineCrashLoop")
    assert conds([p("a", stuck="engine: ImagePullBackOff: x"), p("b"), p("c")])["Ready"][1] == "ImagePullFailed"


def test_scaled_to_zero_is_not_ready():
    spec = parse_spec("m", {"model": {"uri": "pvc://m/x"}, "replicas": 0, "minReplicas": 0})
    assert conds([], spec)["Ready"] == ("False", "ScaledToZero")


def test_adapters_that_do_not_fit_are_named():
    spec = parse_spec("m", {"model": {"uri": "pvc://m/x"}, "replicas": 1,
                            "adapters": [{"name": n, "uri": f"pvc://l/{n}"} for n in "abc"],
                            "adapterPool": {"maxLorasPerReplica": 2}})
    placement = place_adapters(["a", "b", "c"], ["p"], {}, 1, 2)
    plan = assign_roles([p("p", "active", True)], 1)
    cond = conditions_for(spec, [p("p", "active", True)], plan, placement)[3]
    assert (cond.status, cond.reason) == (False, "InsufficientCapacity") and "c (1 missing)" in cond.message


def test_transition_time_moves_only_when_status_does():
    first = render_conditions(conditions_for(SPEC, [], assign_roles([], 2), None), [], 1, "T1")
    same = render_conditions(conditions_for(SPEC, [], assign_roles([], 2), None), first, 2, "T2")
    assert all(c["lastTransitionTime"] == "T1" and c["observedGeneration"] == 2 for c in same)
    pods = [p("a", "active", True), p("b", "active", True), p("c", "standby", True)]
    changed = {c["type"]: c for c in render_conditions(conditions_for(SPEC, pods, assign_roles(pods, 2), None),
                                                        same, 2, "T3")}
    assert changed["Ready"]["lastTransitionTime"] == "T3"  # False -> True
    assert changed["AdaptersPlaced"]["lastTransitionTime"] == "T1"  # stayed True


def test_status_counts_and_endpoint():
    pods = [p("a", "active", True), p("b", "active", False), p("c", "standby", True)]
    body = {"metadata": {"name": "m", "namespace": "ml", "generation": 4}}
    status = build_status(body, SPEC, pods, assign_roles(pods, 2), None, "T")
    assert (status["replicas"], status["readyReplicas"], status["standbyReplicas"]) == (2, 2, 0)
    assert status["observedGeneration"] == 4 and status["endpoint"] == "http://m.ml.svc:8000"
    assert status["selector"] == "app.kubernetes.io/name=kubeinfer-engine,app.kubernetes.io/instance=m," \
                                 "serving.kubeinfer.io/role=active"


# -- autoscaling ---------------------------------------------------------------------------------------
AUTO = parse_spec("m", {"model": {"uri": "pvc://m/x"}, "replicas": 2, "minReplicas": 1, "maxReplicas": 6,
                        "autoscaling": {"targetQueueDepth": 4, "scaleDownDelaySeconds": 60}})


@pytest.mark.parametrize("depths, expected", [([8, 8], 4), ([4.2, 4.0], 2), ([0, 0], 1), ([50, 50], 6),
                                              ([], 2), ([3, 3], 2), ([2, 2], 1)])
def test_recommendation_follows_the_average_queue(depths, expected):
    assert recommend(2, depths, 4, 1, 6) == expected


def test_scale_up_is_immediate_and_scale_down_waits_then_steps():
    scaler = Autoscaler()
    assert scaler.decide("m", AUTO, [12, 12], now=0) == 6
    scaler = Autoscaler()
    assert scaler.decide("m", AUTO, [0, 0], now=0) == 2  # a fresh operator has seen no calm yet
    assert scaler.decide("m", AUTO, [0, 0], now=30) == 2
    assert scaler.decide("m", AUTO, [0, 0], now=61) == 1  # calm for the whole delay: one step down
    busy = Autoscaler()
    busy.decide("m", AUTO, [0, 0], now=0)
    busy.decide("m", AUTO, [8, 8], now=40)  # a burst inside the window keeps the pods
    assert busy.decide("m", AUTO, [0, 0], now=61) == 2


def test_autoscaling_off_keeps_replicas():
    assert Autoscaler().decide("m", SPEC, [100], now=0) == SPEC.replicas


def test_queue_depth_is_read_from_prometheus_text():
    registry = CollectorRegistry()
    gauge = Gauge("vllm:num_requests_waiting", "waiting", ["model_name"], registry=registry)
    gauge.labels(model_name="llama").set(7)
    assert parse_queue_depth(generate_latest(registry).decode()) == 7.0
    assert parse_queue_depth("# nothing here\n") is None


async def test_http_source_scrapes_each_pod_and_skips_unreachable_ones():
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_waiting", "waiting", ["model_name"], registry=registry).labels(model_name="m").set(3)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")
    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        source = HttpQueueDepths(timeout=1.0, port=port)
        got = await source.queue_depths([PodView("up", ip="127.0.0.1"), PodView("down", ip="127.0.0.2"),
                                         PodView("no-ip")])
        assert got == {"up": 3.0}
    finally:
        await runner.cleanup()
