"""One pass's writes on the model's pods: each pod's role (active or standby, and the deletion cost that
makes a scale-down take standby pods first) and the adapters placed on it, as labels and annotations the
gateway and the engines read; then what the engines report loaded."""
from __future__ import annotations

from typing import Any

from kubeinfer.operator.kube import KubeClient
from kubeinfer.operator.loaded import LoadedAdapterSource, Observed
from kubeinfer.operator.names import ACTIVE, ADAPTERS_ANNOTATION, DELETION_COST_ANNOTATION, ROLE_LABEL
from kubeinfer.operator.placement import Placement, place_adapters
from kubeinfer.operator.pods import PodView
from kubeinfer.operator.roles import RolePlan, assign_roles
from kubeinfer.operator.spec import InferenceModelSpec

DELETION_COST = {ACTIVE: "100"}  # standby pods keep the default 0 and go first on a scale-down


async def patch_pod(client: KubeClient, namespace: str, pod: str, labels: dict[str, Any] | None = None,
                    annotations: dict[str, Any] | None = None) -> None:
    meta = {key: value for key, value in (("labels", labels), ("annotations", annotations)) if value is not None}
    await client.patch("v1", "pods", namespace, pod, {"metadata": meta})


async def apply_roles(client: KubeClient, body: dict[str, Any], spec: InferenceModelSpec,
                      pods: list[PodView]) -> RolePlan:
    namespace = body["metadata"]["namespace"]
    plan = assign_roles(pods, spec.replicas)
    for pod, role in sorted(plan.changes(pods).items()):
        await patch_pod(client, namespace, pod, labels={ROLE_LABEL: role},
                        annotations={DELETION_COST_ANNOTATION: DELETION_COST.get(role, "0")})
    if plan.promoted:
        lost = [p.name for p in pods if p.role == ACTIVE and p.name not in plan.active()]
        why = f" replacing {', '.join(lost)}" if lost else " (scale-up)"
        await client.event(body, "Normal", "StandbyPromoted",
                           f"promoted ready standby pod(s) {', '.join(plan.promoted)} to active{why}")
    return plan


async def apply_placement(client: KubeClient, body: dict[str, Any], spec: InferenceModelSpec, pods: list[PodView],
                          plan: RolePlan) -> Placement | None:
    namespace = body["metadata"]["namespace"]
    by_name = {p.name: p for p in pods}
    active = plan.active()
    # Adapters go where requests can be served now; until a pod is ready, on any active pod.
    targets = [n for n in active if by_name[n].ready] or active
    current = {p.name: p.adapters for p in pods}
    placement = None
    wanted: dict[str, tuple[str, ...]] = {}
    if spec.adapters and targets:
        placement = place_adapters([a.name for a in spec.adapters], targets, current,
                                   spec.adapter_pool.replicas_per_adapter,
                                   spec.adapter_pool.max_loras_per_replica)
        wanted.update(placement.assignment)
    for name, role in plan.roles.items():
        if role != ACTIVE:
            wanted[name] = ()  # standby pods hold nothing: adapters load in seconds on promotion
    known = {a.name for a in spec.adapters}
    for name in active:  # active pods left out keep what they hold, minus adapters no longer in the spec
        wanted.setdefault(name, tuple(a for a in current.get(name, ()) if a in known))
    changed = {n: a for n, a in wanted.items() if tuple(current.get(n, ())) != a}
    for pod, adapters in sorted(changed.items()):
        await patch_pod(client, namespace, pod, annotations={ADAPTERS_ANNOTATION: ",".join(adapters)})
    if changed:
        summary = "; ".join(f"{pod}: {','.join(a) or '(none)'}" for pod, a in sorted(changed.items()))
        await client.event(body, "Normal", "AdapterPlacementChanged", f"adapters now on: {summary}")
    return placement


async def observe_adapters(engines: LoadedAdapterSource, spec: InferenceModelSpec, pods: list[PodView],
                           placement: Placement | None) -> Observed | None:
    if not spec.adapters or placement is None:
        return None
    by_name = {p.name: p for p in pods}
    return await engines.observe([by_name[n] for n in sorted(placement.assignment)])
