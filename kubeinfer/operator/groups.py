"""The units that serve: engine pods, or, over several nodes, LeaderWorkerSet groups seen through their leaders.

Roles, adapter placement, status and autoscaling work on PodViews. For a multi-node model each group is one
PodView named after its leader pod (worker index 0): the pod that serves the API, carries the role label and
the adapter annotation, and whose IP answers /metrics and /v1/models. The group is ready only when every one
of its pods is; a worker that cannot be scheduled or keeps crashing is the group's trouble, and the view
names that worker. Pods of the other shape (an earlier Deployment's or LeaderWorkerSet's, on their way out
after nodes changed) are no unit: they are never promoted or given adapters.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from kubeinfer.operator.leader_worker import GROUP_INDEX_LABEL, SET_NAME_LABEL, WORKER_INDEX_LABEL
from kubeinfer.operator.pods import PodView, pod_view


def _labels(pod: dict[str, Any]) -> dict[str, str]:
    return (pod.get("metadata") or {}).get("labels") or {}


def serving_units(pods: list[dict[str, Any]], nodes: int) -> list[PodView]:
    if nodes == 1:
        return [pod_view(p) for p in pods if SET_NAME_LABEL not in _labels(p)]
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for pod in pods:
        labels = _labels(pod)
        if SET_NAME_LABEL in labels and GROUP_INDEX_LABEL in labels:
            groups[f"{labels[SET_NAME_LABEL]}/{labels[GROUP_INDEX_LABEL]}"].append(pod)
    units = []
    for members in groups.values():
        leader = next((p for p in members if _labels(p).get(WORKER_INDEX_LABEL) == "0"), None)
        if leader is not None:  # a group without its leader is being recreated as a whole
            units.append(group_view(pod_view(leader), [pod_view(p) for p in members if p is not leader], nodes))
    return units


def group_view(leader: PodView, workers: list[PodView], nodes: int) -> PodView:
    """The leader's view, ready only with all nodes - 1 workers ready, carrying the first trouble of the group."""
    ready = leader.ready and len([w for w in workers if not w.deleting]) == nodes - 1 and all(w.ready for w in workers)
    view = dataclasses.replace(leader, ready=ready)
    if leader.unschedulable or leader.stuck:
        return view
    for worker in sorted(workers, key=lambda w: w.name):
        if worker.unschedulable or worker.stuck:
            return dataclasses.replace(view, unschedulable=worker.unschedulable, stuck=worker.stuck,
                                       trouble_of=worker.name)
    return view
