"""A model that idles and wakes at 100 pods: the gateway's hold and its one /scale ask, the operator's
real `Autoscaler` and its standby promotion, on the discrete-event pods of routing_sim.py.

Timeline: `busy_s` of traffic that keeps about 100 pods busy (the model starts at 100 active pods), then
`idle_s` without a request (longer than scaleDownDelaySeconds, so the autoscaler takes the model to
0 active pods; standby pods stay warm and unrouted), then the same traffic again, at once.

The operator: every `resync_s`, `Autoscaler.decide` on the waiting counts of the routable active pods
(and at once after the gateway's /scale write). The Deployment keeps replicas + standby pods; roles go
to ready pods first, so a scale-up promotes ready standbys (routable `promote_s` later: the relabel,
the watch event and the gateway's first poll) and new pods start cold (routable after `cold_start_s`,
jittered by 20%: scheduling, image, model load). A promoted standby is replaced by a new, cold pod.

The gateway: the real `Picker` over every routable pod, polled every 0.25 s; a request that finds no
routable pod is held, in arrival order, and the first one asks /scale for the real `ScaleTarget`'s
`replicas_for(held)` (as many pods as the held requests need at targetQueueDepth, up to maxReplicas),
again at most every second while the hold grows (`sized_ask=False`: max(1, minReplicas), once). Held
requests count nowhere the autoscaler looks, as in the cluster: it sees them once they are released onto
the first pod and wait there. With `fair_queue`, a request that finds every routable pod saturated waits
at the gateway (up to 30 s) instead, and is dispatched as pods free up or join.
"""
from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field, replace

from routing_sim import BASE, PodSpec, SimRequest, Workload, build_workload, percentile
from routing_sim import Pod as EnginePod

from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool
from kubeinfer.gateway.flowcontrol.model_priorities import ScaleTarget
from kubeinfer.gateway.scheduling.picker import Picker, PickerConfig, RoutingError, RoutingRequest
from kubeinfer.operator.autoscale import Autoscaler
from kubeinfer.operator.spec import parse_spec


@dataclass(frozen=True)
class WakeScenario:
    pods: int = 100  # maxReplicas, and the replicas the busy phase starts at
    rate_per_pod: float = 1.0  # requests/s per pod of `pods`, in both busy phases
    busy_s: float = 300.0
    idle_s: float = 420.0
    target_queue_depth: float = 4.0
    scale_down_delay_s: int = 300
    resync_s: float = 15.0
    promote_s: float = 0.2  # measured: 0.09 s gateway (bench_scale_from_zero.py) + 0.09 s operator and watch
    cold_start_s: float = 60.0  # an 8B model on a GPU node that has the image: schedule, load, warm up
    scrape_s: float = 0.25
    seed: int = 0


@dataclass
class SimPod:
    engine: EnginePod
    endpoint: Endpoint
    ready_at: float  # when its engine is up
    active: bool = False
    routable: bool = False  # in the gateway's pool


@dataclass
class WakeResult:
    name: str
    wake_ttft: list[float]  # requests of the second busy phase
    first_wake_ttft: float
    max_held: int
    pod_seconds: float  # pods that existed (active, standby or starting) times how long, until the horizon
    horizon_s: float  # the end of the second busy phase
    replicas_trace: list[tuple[float, int]] = field(default_factory=list)

    def ttft(self, q: int) -> float:
        return percentile(self.wake_ttft, q)


FAIR_QUEUE_TIMEOUT_S = 30.0  # the gateway's --fair-queue-timeout default
REASK_S = 1.0  # kubeinfer/gateway/flowcontrol/hold.py's REASK_SECONDS


def simulate_wake(s: WakeScenario, standby: int, scale_to_zero: bool = True, spec: PodSpec = PodSpec(),
                  name: str = "", sized_ask: bool = True, fair_queue: bool = False) -> WakeResult:
    rng = random.Random(s.seed)
    model = parse_spec("wake", {
        "model": {"uri": "hf://example/model", "servedName": BASE}, "replicas": s.pods,
        "minReplicas": 0 if scale_to_zero else s.pods, "maxReplicas": s.pods, "standby": {"replicas": standby},
        "autoscaling": {"targetQueueDepth": s.target_queue_depth, "scaleDownDelaySeconds": s.scale_down_delay_s}})
    autoscaler = Autoscaler()
    target = ScaleTarget("default", "wake", model.min_replicas, model.max_replicas,
                         s.target_queue_depth if sized_ask else None)
    queued: deque[tuple[float, SimRequest]] = deque()  # (since, request) waiting for a free pod (fair_queue)
    pool = EndpointPool()
    picker = Picker(pool, replace(PickerConfig(), stale_after=math.inf), rng=random.Random(s.seed),
                    clock=lambda: now)
    pods: list[SimPod] = []
    serial = 0
    held: deque[SimRequest] = deque()
    asked, asked_for, asked_at, max_held, pod_seconds, last_t = False, 0, -math.inf, 0, 0.0, 0.0
    now = 0.0
    events: list[tuple[float, int, str, object]] = []
    counter = 0

    def push(t: float, kind: str, payload: object = None) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, payload))

    def new_pod(ready_at: float) -> SimPod:
        nonlocal serial
        serial += 1
        pod = SimPod(EnginePod(spec, []), Endpoint(f"10.9.{serial // 250}.{serial % 250}:8000"), ready_at)
        push(ready_at, "ready", pod)
        return pod

    def publish() -> None:
        pool.set_members([p.endpoint for p in pods if p.routable])
        for p in pods:
            if p.routable and p.endpoint.last_scrape is None:
                p.endpoint.record_scrape(p.engine.state(), p.engine.models, frozenset([BASE]), started=now)

    def reconcile() -> None:
        """The Deployment's size, then roles: the best `replicas` pods serve, ready ones first."""
        want = model.replicas + model.standby
        while len(pods) < want:
            pods.append(new_pod(now + s.cold_start_s * rng.uniform(0.8, 1.2)))
        if len(pods) > want:  # a Deployment scales down not-ready pods first, then idle ones
            pods.sort(key=lambda p: (p.ready_at <= now, p.engine.running + len(p.engine.waiting) > 0))
            del pods[:len(pods) - want]
        ranked = sorted(pods, key=lambda p: (not p.active, p.ready_at > now, p.ready_at))
        for i, p in enumerate(ranked):
            serve = i < model.replicas
            if serve and not p.active:
                p.active = True
                if p.ready_at <= now:  # a promotion: routable once the gateway hears of it
                    push(now + s.promote_s, "routable", p)
            elif not serve and p.active:
                p.active = p.routable = False
        publish()

    def ask_if_needed() -> None:
        """The hold's asks: the first held request, then (sized) a grown hold at most every REASK_S."""
        nonlocal asked, asked_for, asked_at
        if asked and (not sized_ask or len(held) <= asked_for or now - asked_at < REASK_S):
            return
        asked, asked_for, asked_at = True, len(held), now
        push(now, "scale_up", target.replicas_for(len(held)))

    def route(r: SimRequest) -> None:
        nonlocal max_held
        if fair_queue and any(p.routable for p in pods) and not picker.has_free_endpoint(RoutingRequest(r.model)):
            queued.append((now, r))
            return
        try:
            decision = picker.pick(RoutingRequest(r.model, r.text))
        except RoutingError:
            held.append(r)
            max_held = max(max_held, len(held))
            ask_if_needed()
            return
        dispatch(r, decision)

    def dispatch(r: SimRequest, decision) -> None:
        pod = next(p for p in pods if p.endpoint is decision.endpoint)
        pod.engine.waiting.append(r)
        if not pod.engine.busy:
            start(pod.engine)

    def drain_queue() -> None:
        """The fair queue: dispatch while a pod is free, and whatever has waited its longest anyway."""
        while queued and (picker.has_free_endpoint(RoutingRequest(queued[0][1].model))
                          or now - queued[0][0] >= FAIR_QUEUE_TIMEOUT_S):
            r = queued.popleft()[1]
            dispatch(r, picker.pick(RoutingRequest(r.model, r.text)))

    def start(engine: EnginePod) -> None:
        planned = engine.start_step()
        engine.busy = planned is not None
        if planned:
            push(now + planned[0], "step", (engine, planned[1]))

    workload = Workload(requests=int(s.busy_s * s.rate_per_pod * s.pods), rate=s.rate_per_pod * s.pods,
                        base_system_prompts=s.pods, adapters=0, seed=s.seed)
    first = build_workload(workload, spec.block_size)
    second = build_workload(replace(workload, seed=s.seed + 1), spec.block_size)
    wake_at = first[-1].arrival + s.idle_s
    for r in second:
        r.arrival += wake_at
    requests = first + second
    horizon = wake_at + s.busy_s
    for i, r in enumerate(requests):
        r.id = i
        push(r.arrival, "arrival", r)
    reconcile()
    for p in pods:
        p.ready_at = 0.0  # the busy phase starts with its pods up
    reconcile()
    for p in pods:
        if p.active:
            p.routable = True
    publish()
    push(s.resync_s, "resync")
    push(s.scrape_s, "scrape")
    trace = [(0.0, model.replicas)]
    finished = 0
    while finished < len(requests):
        now, _, kind, payload = heapq.heappop(events)
        pod_seconds += len(pods) * max(0.0, min(now, horizon) - last_t)
        last_t = max(last_t, min(now, horizon))
        if kind == "arrival":
            if queued:  # no overtaking the fair queue
                queued.append((now, payload))
            else:
                route(payload)
        elif kind == "step":
            engine, chunks = payload
            finished += len(engine.finish_step(now, chunks))
            start(engine)
        elif kind == "scrape":
            for p in pods:
                if p.routable:
                    p.endpoint.record_scrape(p.engine.state(), p.engine.models, frozenset([BASE]), started=now)
            drain_queue()
            push(now + s.scrape_s, "scrape")
        elif kind in ("resync", "scale_up"):
            if kind == "scale_up":  # /scale: only ever up, never past what is already there
                replicas = max(model.replicas, payload)
            else:
                routable = [p for p in pods if p.routable]
                depths = [float(len(p.engine.waiting)) for p in routable]
                # as the operator: idle only on a full reading of no work, never with no pod to read
                idle = bool(routable) and all(p.engine.running + len(p.engine.waiting) == 0 for p in routable)
                replicas = autoscaler.decide("wake", model, depths, now, idle=idle)
                push(now + s.resync_s, "resync")
            if replicas != model.replicas:
                model = replace(model, replicas=replicas)
                trace.append((now, replicas))
                reconcile()
        elif kind in ("ready", "routable"):
            pod = payload
            if pod in pods and pod.active and pod.ready_at <= now and not pod.routable:
                pod.routable = True
                asked = False  # the model is up: a later wake-up asks anew (as HoldQueue does)
                publish()
                while held and any(p.routable for p in pods):  # released in arrival order
                    route(held.popleft())
                drain_queue()
    wake = second
    return WakeResult(name, [r.first_token_at - r.arrival for r in wake],
                      min(wake, key=lambda r: r.arrival).first_token_at - wake_at, max_held, pod_seconds, horizon,
                      trace)
