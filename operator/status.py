"""InferenceModel status: replica counts and the Ready, Progressing, Degraded and AdaptersPlaced conditions.

Conditions have metav1.Condition's shape; lastTransitionTime only moves when a condition's status does.
"""
from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
            return reason, f"pod {pod.name} cannot be scheduled: {pod.unschedulable}"
    for pod in pods:
        if pod.stuck:
            reason = "EngineCrashLoop" if "CrashLoopBackOff" in pod.stuck else "ContainerNotStarting"
            if "Image" in pod.stuck:
                reason = "ImagePullFailed"
            return reason, f"pod {pod.name}: {pod.stuck}"
    return None


def conditions_for(spec: InferenceModelSpec, pods: Sequence[PodView], plan: RolePlan,
                   placement: Placement | None) -> list[Condition]:
    alive = live(list(pods))
    by_name = {p.name: p for p in alive}
    ready_active = sum(by_name[n].ready for n in plan.active())
    standby = [by_name[n] for n, r in plan.roles.items() if r == STANDBY]
    ready_standby = sum(p.ready for p in standby)
    counts = f"{ready_active}/{spec.replicas} active and {ready_standby}/{spec.standby} standby replicas ready"
    trouble = _trouble(alive, spec.engine.resources.gpu_resource_name)

    if spec.replicas == 0:
        ready = Condition("Ready", False, "ScaledToZero", "spec.replicas is 0: nothing serves this model")
    elif ready_active > 0:
        ready = Condition("Ready", True, "Serving", counts)
    elif trouble:
        ready = Condition("Ready", False, *trouble)
    elif not alive:
        ready = Condition("Ready", False, "PodsPending", "waiting for the Deployment to create engine pods")
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
    return [ready, progressing, degraded, adapters_condition(spec, placement)]


def adapters_condition(spec: InferenceModelSpec, placement: Placement | None) -> Condition:
    if not spec.adapters:
        return Condition("AdaptersPlaced", True, "NoAdapters", "spec.adapters is empty")
    if placement is None or not placement.assignment:
        return Condition("AdaptersPlaced", False, "NoActivePods", "no active pod to place adapters on yet")
    if placement.unplaced:
        missing = ", ".join(f"{name} ({n} missing)" for name, n in sorted(placement.unplaced.items()))
        return Condition("AdaptersPlaced", False, "InsufficientCapacity",
                         f"not enough adapter slots for: {missing}; raise spec.adapterPool.maxLorasPerReplica "
                         "or spec.replicas, or lower spec.adapterPool.replicasPerAdapter")
    return Condition("AdaptersPlaced", True, "Placed",
                     f"{len(spec.adapters)} adapters on {len(placement.assignment)} active pods")


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


def invalid_status(message: str, previous: Sequence[dict[str, Any]], generation: int, now: str) -> dict[str, Any]:
    """Status of a spec the operator refuses: nothing was built for it."""
    conds = [Condition("Ready", False, "InvalidSpec", message),
             Condition("Progressing", False, "InvalidSpec", "fix the spec; nothing is built until then"),
             Condition("Degraded", True, "InvalidSpec", message)]
    return {"observedGeneration": generation, "conditions": render_conditions(conds, previous, generation, now)}


def build_status(body: dict[str, Any], spec: InferenceModelSpec, pods: Sequence[PodView], plan: RolePlan,
                 placement: Placement | None, now: str) -> dict[str, Any]:
    meta = body["metadata"]
    generation = int(meta.get("generation") or 0)
    by_name = {p.name: p for p in pods}
    active = plan.active()
    holders = placement.holders() if placement else {}
    return {
        "observedGeneration": generation,
        "replicas": len(active),
        "readyReplicas": sum(by_name[n].ready for n in active),
        "standbyReplicas": sum(by_name[n].ready for n, r in plan.roles.items() if r == STANDBY),
        "selector": selector_string(active_labels(spec.name)),
        "endpoint": f"http://{spec.name}.{meta['namespace']}.svc:{HTTP_PORT}",
        "adapters": [{"name": a.name, "pods": holders.get(a.name, [])} for a in spec.adapters],
        "conditions": render_conditions(conditions_for(spec, pods, plan, placement),
                                        (body.get("status") or {}).get("conditions") or [], generation, now),
    }

