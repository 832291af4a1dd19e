"""Queue-depth autoscaling of spec.replicas, with a scale-down delay.

Like the HorizontalPodAutoscaler on an average-value metric: desired = ceil(active * average waiting /
target), unchanged within a 10 % tolerance, clamped to minReplicas..maxReplicas. Scaling up acts at
once (a ready standby is promoted first, because roles follow spec.replicas). Scaling down takes the
highest recommendation seen during scaleDownDelaySeconds, and removes one pod at a time, since each
pod removed is a model load to get back. Where the queue depths come from is injectable.
"""
from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from kubeinfer.operator.names import HTTP_PORT
from kubeinfer.operator.pods import PodView
from kubeinfer.operator.spec import InferenceModelSpec

TOLERANCE = 0.1
QUEUE_METRIC = "vllm:num_requests_waiting"


class QueueDepthSource(Protocol):
    async def queue_depths(self, pods: Sequence[PodView]) -> dict[str, float]:
        """Waiting requests per pod name; pods that could not be read are left out."""


def recommend(current: int, depths: Sequence[float], target: float, low: int, high: int) -> int:
    if not depths:
        return current  # no data is no reason to move
    ratio = (sum(depths) / len(depths)) / target
    desired = current if abs(ratio - 1.0) <= TOLERANCE else math.ceil(max(current, 1) * ratio)
    return max(low, min(high, desired))


class Autoscaler:
    """Remembers each model's recent recommendations: the window that delays a scale-down."""

    def __init__(self) -> None:
        self._history: dict[str, deque[tuple[float, int]]] = {}

    def forget(self, key: str) -> None:
        self._history.pop(key, None)

    def decide(self, key: str, spec: InferenceModelSpec, depths: Sequence[float], now: float) -> int:
        """The spec.replicas to set now (may equal the current one)."""
        auto = spec.autoscaling
        if auto is None or spec.max_replicas is None:
            return spec.replicas
        current = spec.replicas
        history = self._history.get(key)
        if history is None:  # a fresh operator has seen no low load yet: the window starts now
            history = self._history[key] = deque([(now, current)])
        wanted = recommend(current, depths, auto.target_queue_depth, spec.min_replicas, spec.max_replicas)
        history.append((now, wanted))
        while len(history) > 1 and history[0][0] < now - auto.scale_down_delay_seconds:
            history.popleft()
        if wanted >= current:
            return wanted
        stable = max(n for _, n in history)
        return max(stable, current - 1) if stable < current else current


def parse_queue_depth(text: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        if family.name == QUEUE_METRIC:
            return sum(sample.value for sample in family.samples)
    return None


class HttpQueueDepths:
    """Reads vllm:num_requests_waiting from each pod's /metrics (needs the pod network: run in-cluster)."""

    def __init__(self, timeout: float = 2.0, port: int = HTTP_PORT):
        self.timeout = timeout
        self.port = port

    async def _one(self, client, pod: PodView) -> tuple[str, float | None]:
        try:
            response = await client.get(f"http://{pod.ip}:{self.port}/metrics")
            response.raise_for_status()
            return pod.name, parse_queue_depth(response.text)
        except Exception:  # an unreachable pod is simply left out of the average
            return pod.name, None

    async def queue_depths(self, pods: Sequence[PodView]) -> dict[str, float]:
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout) as client:
            results = await asyncio.gather(*(self._one(client, p) for p in pods if p.ip))
        return {name: value for name, value in results if value is not None}
