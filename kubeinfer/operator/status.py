"""InferenceModel status: replica counts and the Ready, Progressing, Degraded and AdaptersPlaced conditions.

Conditions have metav1.Condition's shape; lastTransitionTime only moves when a condition's status does.
"""
from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kubeinfer.operator.errors import FORBIDDEN, TERMINATING, Failure
from kubeinfer.operator.loaded import Observed
from kubeinfer.operator.names import HTTP_PORT, STANDBY, active_labels, selector_string
from kubeinfer.operator.placement import Placement
from kubeinfer.operator.pods import PodView
from kubeinfer.operator.roles import RolePlan, live
from kubeinfer.operator.spec import InferenceModelSpec

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "AdaptersPlaced")


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _trouble(pods: Sequence[PodView], gpu_resource: str) -> tuple[str, str] | None:
    """(reason, message) for the first pod that will not become ready by itself."""
    for pod in pods:
        if pod.unschedulable:
            reason = "NoGPUCapacity" if gpu_resource in pod.unschedulable else "Unschedulable"
            return reason, f"pod {pod.trouble_of or pod.name} cannot be scheduled: {pod.unschedulable}"
    for pod in pods:
        if pod.stuck:
            why = pod.stuck.split(": ")[1] if ": " in pod.stuck else ""  # "<container>: <reason>: <message>"
            reason = "EngineCrashLoop" if why in ("CrashLoopBackOff", "Terminated") else "ContainerNotStarting"
            if "Image" in why:
                reason = "ImagePullFailed"
            return reason, f"pod {pod.trouble_of or pod.name}: {pod.stuck}"
    return None


def current(pods: Sequence[PodView], template: str | None) -> list[PodView]:
    """The pods made from `template` (and those not stamped): an earlier template's pods are on their way out,
    so their trouble is history, not the model's state."""
    return [p for p in pods if template is None or p.template is None or p.template == template]


def conditions_for(spec: InferenceModelSpec, pods: Sequence[PodView], plan: RolePlan,
                   placement: Placement | None, observed: Observed | None = None,
                   template: str | None = None) -> list[Condition]:
    alive = live(list(pods))
    by_name = {p.name: p for p in alive}
    ready_active = sum(by_name[n].ready for n in plan.active())
    standby = [by_name[n] for n, r in plan.roles.items() if r == STANDBY]
    ready_standby = sum(p.ready for p in standby)
    counts = f"{ready_active}/{spec.replicas} active and {ready_standby}/{spec.standby} standby replicas ready"
    trouble = _trouble(current(alive, template), spec.engine.resources.gpu_resource_name)

    if spec.replicas == 0:
        ready = Condition("Ready", False, "ScaledToZero", "spec.replicas is 0: nothing serves this model")
    elif ready_active > 0:
        ready = Condition("Ready", True, "Serving", counts)
    elif trouble:
        ready = Condition("Ready", False, *trouble)
    elif not alive:
        workload = "LeaderWorkerSet" if spec.engine.parallelism.nodes > 1 else "Deployment"
        ready = Condition("Ready", False, "PodsPending", f"waiting for the {workload} to create engine pods")
    else:
        ready = Condition("Ready", False, "ModelLoading", f"engine pods are starting or loading the model; {counts}")

    converged = ready_active >= spec.replicas and ready_standby >= spec.standby and len(alive) == spec.pods
    if converged:
        progressing = Condition("Progressing", False, "Complete", counts)
    elif trouble:
        progressing = Condition("Progressing", False, "Stalled", f"{trouble[1]}; {counts}")
    else:
        progressing = Condition("Progressing", True, "Reconciling", counts)

    if trouble is None:
        degraded = Condition("Degraded", False, "AsExpected", counts)
    elif ready_active >= spec.replicas:
        degraded = Condition("Degraded", True, "StandbyUnavailable",
                             f"standby cannot be restored: {trouble[1]}; {counts}")
    else:
        degraded = Condition("Degraded", True, trouble[0], f"{trouble[1]}; {counts}")
    return [ready, progressing, degraded, adapters_condition(spec, placement, observed)]


def adapters_condition(spec: InferenceModelSpec, placement: Placement | None,
                       observed: Observed | None = None) -> Condition:
    """True only when every adapter is loaded on every pod it is assigned to, as the pods themselves say."""
    if not spec.adapters:
        return Condition("AdaptersPlaced", True, "NoAdapters", "spec.adapters is empty")
    if placement is None or not placement.assignment:
        return Condition("AdaptersPlaced", False, "NoActivePods", "no active pod to place adapters on yet")
    if placement.unplaced:
        missing = ", ".join(f"{name} ({n} missing)" for name, n in sorted(placement.unplaced.items()))
        return Condition("AdaptersPlaced", False, "InsufficientCapacity",
                         f"not enough adapter slots for: {missing}; raise spec.adapterPool.maxLorasPerReplica "
                         "or spec.replicas, or lower spec.adapterPool.replicasPerAdapter")
    observed = observed or Observed()
    not_loaded, unknown = [], []
    for adapter, pods in sorted(placement.holders().items()):
        for pod in pods:
            if pod in observed.unknown:
                unknown.append(f"{adapter} on {pod}: {observed.unknown[pod]}")
            elif pod not in observed.loaded:
                unknown.append(f"{adapter} on {pod}: not observed")
            elif adapter not in observed.loaded[pod]:
                not_loaded.append(f"{adapter} on {pod}")
    if not_loaded:
        return Condition("AdaptersPlaced", False, "NotLoaded",
                         f"assigned but not in the pod's /v1/models (loading, or the load failed: see the engine "
                         f"pod's log): {'; '.join(not_loaded + unknown)}")
    if unknown:
        return Condition("AdaptersPlaced", False, "Unobserved",
                         f"cannot tell whether adapters are loaded: {'; '.join(unknown)}; the operator reads each "
                         "active pod's /v1/models on port 8000 (run it in-cluster, allow it in NetworkPolicies)")
    return Condition("AdaptersPlaced", True, "Placed",
                     f"{len(spec.adapters)} adapters loaded on {len(placement.assignment)} active pods")


def failure_conditions(failure: Failure, previous: Sequence[dict[str, Any]]) -> list[Condition]:
    """A refused call (403) or a retried one: Degraded or Progressing says so; Ready keeps what it was."""
    before = {c.get("type"): c for c in previous or []}
    ready = before.get("Ready")
    kept = Condition("Ready", ready.get("status") == "True", ready.get("reason") or "Unknown",
                     ready.get("message") or "") if ready else Condition("Ready", False, failure.reason, failure.message)
    if failure.reason == FORBIDDEN:
        return [kept, Condition("Progressing", False, FORBIDDEN, "stopped until the permission is granted; "
                                                                 "retried on every resync"),
                Condition("Degraded", True, FORBIDDEN, failure.message)]
    if failure.reason == TERMINATING:
        return [kept, Condition("Progressing", False, TERMINATING, failure.message)]
    return [kept, Condition("Progressing", True, failure.reason, failure.message)]


def render_conditions(conditions: Sequence[Condition], previous: Sequence[dict[str, Any]], generation: int,
                      now: str) -> list[dict[str, Any]]:
    before = {c.get("type"): c for c in previous or []}
    out = []
    for c in conditions:
        status = "True" if c.status else "False"
        old = before.get(c.type, {})
        since = old.get("lastTransitionTime") if old.get("status") == status and old.get("lastTransitionTime") else now
        out.append({"type": c.type, "status": status, "reason": c.reason, "message": c.message,
                    "lastTransitionTime": since, "observedGeneration": generation})
    return out


def invalid_status(message: str, previous: Sequence[dict[str, Any]], generation: int, now: str,
                   reason: str = "InvalidSpec", progress: str | None = None) -> dict[str, Any]:
    """Status of a spec the operator refuses (InvalidSpec, PolicyViolation, ServedNameConflict) or cannot build
    here (LeaderWorkerSetMissing): nothing was built."""
    conds = [Condition("Ready", False, reason, message),
             Condition("Progressing", False, reason, progress or "fix the spec; nothing is built until then"),
             Condition("Degraded", True, reason, message)]
    return {"observedGeneration": generation, "conditions": render_conditions(conds, previous, generation, now)}


def failure_status(failure: Failure, body: dict[str, Any], now: str) -> dict[str, Any]:
    """The status patch for a pass stopped by a 403 or a retried error: only the conditions it changes."""
    meta = body["metadata"]
    previous = (body.get("status") or {}).get("conditions") or []
    changed = render_conditions(failure_conditions(failure, previous), previous,
                                int(meta.get("generation") or 0), now)
    kept = [c for c in previous if c.get("type") not in {c["type"] for c in changed}]
    return {**(body.get("status") or {}), "conditions": changed + kept}


def build_status(body: dict[str, Any], spec: InferenceModelSpec, pods: Sequence[PodView], plan: RolePlan,
                 placement: Placement | None, now: str, observed: Observed | None = None,
                 template: str | None = None) -> dict[str, Any]:
    meta = body["metadata"]
    generation = int(meta.get("generation") or 0)
    by_name = {p.name: p for p in pods}
    active = plan.active()
    holders = placement.holders() if placement else {}
    loaded = (observed or Observed()).loaded
    return {
        "observedGeneration": generation,
        "replicas": len(active),
        "readyReplicas": sum(by_name[n].ready for n in active),
        "standbyReplicas": sum(by_name[n].ready for n, r in plan.roles.items() if r == STANDBY),
        "selector": selector_string(active_labels(spec.name)),
        "endpoint": f"http://{spec.name}.{meta['namespace']}.svc:{HTTP_PORT}",
        "adapters": [{"name": a.name, "pods": holders.get(a.name, []),
                      "loadedPods": sorted(p for p, names in loaded.items() if a.name in names)}
                     for a in spec.adapters],
        "conditions": render_conditions(conditions_for(spec, pods, plan, placement, observed, template),
                                        (body.get("status") or {}).get("conditions") or [], generation, now),
    }
