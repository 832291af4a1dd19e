"""Which active pod holds which LoRA adapter.

Each adapter goes on `replicas_per_adapter` pods (fewer if fewer pods exist), each pod holds at most
`max_per_pod`, and load is spread evenly. Placement is sticky: what a pod already holds stays there
unless the adapter left the spec, the pod left, or a limit shrank, so pods coming and going move as
few adapters as possible. Only if sticking to the old placement leaves something unplaced that a
fresh placement would fit does everything get placed anew.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    assignment: dict[str, tuple[str, ...]]  # pod -> adapters, in spec order
    unplaced: dict[str, int]  # adapter -> how many of its replicas found no pod

    def holders(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for pod in sorted(self.assignment):
            for adapter in self.assignment[pod]:
                out.setdefault(adapter, []).append(pod)
        return out

    def moves(self, current: Mapping[str, Sequence[str]]) -> int:
        """Adapter loads plus unloads needed to go from `current` to this placement."""
        pods = set(current) | set(self.assignment)
        return sum(len(set(current.get(p, ())) ^ set(self.assignment.get(p, ()))) for p in pods)


def _fill(adapters: Sequence[str], pods: Sequence[str], held: dict[str, list[str]], target: int,
          max_per_pod: int) -> dict[str, int]:
    """Give every adapter up to `target` holders, least-loaded pods first; returns what did not fit."""
    count = {a: sum(a in held[p] for p in pods) for a in adapters}
    order = sorted(adapters, key=lambda a: (count[a] - target, adapters.index(a)))  # neediest first
    unplaced = {}
    for adapter in order:
        free = sorted((p for p in pods if adapter not in held[p] and len(held[p]) < max_per_pod),
                      key=lambda p: (len(held[p]), p))
        for pod in free[:max(0, target - count[adapter])]:
            held[pod].append(adapter)
            count[adapter] += 1
        if count[adapter] < target:
            unplaced[adapter] = target - count[adapter]
    return unplaced


def _sticky(adapters: Sequence[str], pods: Sequence[str], current: Mapping[str, Sequence[str]], target: int,
            max_per_pod: int) -> dict[str, list[str]]:
    wanted = set(adapters)
    held = {p: list(dict.fromkeys(a for a in current.get(p, ()) if a in wanted))[:max_per_pod] for p in pods}
    for adapter in adapters:  # more holders than needed (replicasPerAdapter shrank): unload from the busiest
        holders = sorted((p for p in pods if adapter in held[p]), key=lambda p: (-len(held[p]), p))
        for pod in holders[:max(0, len(holders) - target)]:
            held[pod].remove(adapter)
    return held


def place_adapters(adapters: Sequence[str], pods: Sequence[str], current: Mapping[str, Sequence[str]],
                   replicas_per_adapter: int, max_per_pod: int) -> Placement:
    pods = sorted(set(pods))
    target = min(replicas_per_adapter, len(pods))
    held = _sticky(adapters, pods, current, target, max_per_pod)
    unplaced = _fill(adapters, pods, held, target, max_per_pod)
    if unplaced and target * len(adapters) <= len(pods) * max_per_pod:
        fresh: dict[str, list[str]] = {p: [] for p in pods}
        if not _fill(adapters, pods, fresh, target, max_per_pod):
            held, unplaced = fresh, {}
    order = {a: i for i, a in enumerate(adapters)}
    assignment = {p: tuple(sorted(held[p], key=order.__getitem__)) for p in pods}
    if not pods and adapters:
        unplaced = {a: replicas_per_adapter for a in adapters}
    return Placement(assignment, unplaced)
