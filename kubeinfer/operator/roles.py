"""Which pods serve (active) and which wait warm (standby): promotion without a model load.

The Deployment keeps replicas + standby pods alive; this decides the role label of each. The best
`replicas` pods are active, in this order: ready and already active; ready standby (a promotion);
not ready but already active (still loading, nothing better to swap in); the rest, unschedulable
pods last. Ties keep the older pod, so roles only move when readiness says they must.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kubeinfer.operator.names import ACTIVE, STANDBY
from kubeinfer.operator.pods import PodView


@dataclass(frozen=True)
class RolePlan:
    roles: dict[str, str] = field(default_factory=dict)  # every live pod's role
    promoted: tuple[str, ...] = ()  # ready standby pods that now serve
    demoted: tuple[str, ...] = ()  # active pods that no longer serve

    def changes(self, pods: list[PodView]) -> dict[str, str]:
        """Only the pods whose label must change."""
        current = {p.name: p.role for p in pods}
        return {name: role for name, role in self.roles.items() if current.get(name) != role}

    def active(self) -> list[str]:
        return sorted(name for name, role in self.roles.items() if role == ACTIVE)


def _rank(pod: PodView) -> tuple[int, str, str]:
    if pod.ready:
        tier = 0 if pod.role == ACTIVE else 1
    elif pod.role == ACTIVE:
        tier = 2
    else:
        tier = 4 if (pod.unschedulable or pod.stuck) else 3
    return tier, pod.created, pod.name


def live(pods: list[PodView]) -> list[PodView]:
    """Pods that can still serve: not terminating, not finished."""
    return [p for p in pods if not p.deleting and not p.failed]


def assign_roles(pods: list[PodView], replicas: int) -> RolePlan:
    candidates = sorted(live(pods), key=_rank)
    active = {p.name for p in candidates[:replicas]}
    roles = {p.name: ACTIVE if p.name in active else STANDBY for p in candidates}
    promoted = tuple(p.name for p in candidates if p.name in active and p.role == STANDBY and p.ready)
    demoted = tuple(p.name for p in candidates if p.name not in active and p.role == ACTIVE)
    return RolePlan(roles, promoted, demoted)
