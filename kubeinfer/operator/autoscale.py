"""Queue-depth autoscaling of spec.replicas, with a scale-down delay.

Like the HorizontalPodAutoscaler on an average-value metric: desired = ceil(active * average waiting /
target), unchanged within a 10 % tolerance, clamped to minReplicas..maxReplicas. Scaling up acts at
once (a ready standby is promoted first, because roles follow spec.replicas). Scaling down takes the
highest recommendation seen during scaleDownDelaySeconds, and removes one pod at a time, since each
pod removed is a model load to get back. Where the queue depths come from is injectable.

With `minReplicas: 0` a model that served nothing (no request running or waiting on any active pod)
for the whole scaleDownDelaySeconds goes to 0 active replicas; its standby pods stay warm and unrouted.
The queue rule alone never goes below 1: an empty queue does not mean an idle model. Coming back from 0
is the gateway's call: it holds the first request and asks through /scale.
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
RUNNING_METRIC = "vllm:num_requests_running"


class QueueDepthSource(Protocol):
    async def queue_depths(self, pods: Sequence[PodView]) -> dict[str, float]:
        """Waiting requests per pod name; pods that could not be read are left out."""

    async def activity(self, pods: Sequence[PodView]) -> dict[str, float]:
        """Requests running or waiting per pod name; pods that could not be read are left out."""


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
        self._last_busy: dict[str, float] = {}

    def forget(self, key: str) -> None:
        self._history.pop(key, None)
        self._last_busy.pop(key, None)

    def decide(self, key: str, spec: InferenceModelSpec, depths: Sequence[float], now: float,
               idle: bool = False) -> int:
        """The spec.replicas to set now (may equal the current one). `idle`: every active pod answered and
        none has a request running or waiting."""
        auto = spec.autoscaling
        if auto is None or spec.max_replicas is None:
            return spec.replicas
        current = spec.replicas
        if current == 0:
            return 0  # the gateway asks for capacity when a request comes
        if spec.min_replicas == 0 and self._idle_for(key, idle, now) >= auto.scale_down_delay_seconds:
            self._history.pop(key, None)
            return 0
        history = self._history.get(key)
        if history is None:  # a fresh operator has seen no low load yet: the window starts now
            history = self._history[key] = deque([(now, current)])
        wanted = recommend(current, depths, auto.target_queue_depth, max(1, spec.min_replicas), spec.max_replicas)
        history.append((now, wanted))
        while len(history) > 1 and history[0][0] < now - auto.scale_down_delay_seconds:
            history.popleft()
        if wanted >= current:
            return wanted
        stable = max(n for _, n in history)
        return max(stable, current - 1) if stable < current else current


    def _idle_for(self, key: str, idle: bool, now: float) -> float:
        """Seconds since the model was last seen busy (a fresh operator counts from now)."""
        if not idle or key not in self._last_busy:
            self._last_busy[key] = now
        return now - self._last_busy[key]


def parse_queue_depth(text: str, metric: str = QUEUE_METRIC) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        if family.name == metric:
            return sum(sample.value for sample in family.samples)
    return None


def parse_activity(text: str) -> float | None:
    waiting, running = parse_queue_depth(text), parse_queue_depth(text, RUNNING_METRIC)
    return None if waiting is None or running is None else waiting + running


class HttpQueueDepths:
    """Reads vllm:num_requests_waiting from each pod's /metrics (needs the pod network: run in-cluster).

    /metrics is open on the engine; the key goes along anyway, so the reading survives an engine that
    puts its metrics behind it."""

    def __init__(self, timeout: float = 2.0, port: int = HTTP_PORT, api_key: str = ""):
        self.timeout = timeout
        self.port = port
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def _one(self, client, pod: PodView, parse) -> tuple[str, float | None]:
        try:
            response = await client.get(f"http://{pod.ip}:{self.port}/metrics")
            response.raise_for_status()
            return pod.name, parse(response.text)
        except Exception:  # an unreachable pod is simply left out of the average
            return pod.name, None

    async def _read(self, pods: Sequence[PodView], parse) -> dict[str, float]:
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:
            results = await asyncio.gather(*(self._one(client, p, parse) for p in pods if p.ip))
        return {name: value for name, value in results if value is not None}

    async def queue_depths(self, pods: Sequence[PodView]) -> dict[str, float]:
        return await self._read(pods, parse_queue_depth)

    async def activity(self, pods: Sequence[PodView]) -> dict[str, float]:
        return await self._read(pods, parse_activity)
