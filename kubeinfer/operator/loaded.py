"""Which adapters each engine pod has actually loaded, read from the pod's own `GET /v1/models`.

The annotation says what a pod should hold; only the engine knows whether the load worked (a
missing file, a rank over --max-lora-rank, no free slot). The engine lists its base model and every
loaded adapter there, an adapter being a card whose `parent` is the base model. The operator asks
each active pod directly, as the gateway and the autoscaler do: no extra RBAC, but it needs the pod
network (run in-cluster; the model's NetworkPolicy lets the operator's pods reach port 8000) and, when
engines require a key, that key (the operator's KUBEINFER_ENGINE_API_KEY, the one the gateway presents).
A pod that does not answer within the timeout is reported as unknown, never as loaded.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubeinfer.operator.names import HTTP_PORT
from kubeinfer.operator.pods import PodView


@dataclass(frozen=True)
class Observed:
    loaded: dict[str, tuple[str, ...]] = field(default_factory=dict)  # pod -> adapters it serves
    unknown: dict[str, str] = field(default_factory=dict)  # pod -> why it could not be read


class LoadedAdapterSource(Protocol):
    async def observe(self, pods: Sequence[PodView]) -> Observed:
        """What each pod serves; every pod given is in exactly one of the two maps."""


def adapters_in(models: dict[str, Any]) -> tuple[str, ...]:
    """Adapter ids in an OpenAI `/v1/models` answer (cards with a parent model)."""
    return tuple(sorted(card["id"] for card in models.get("data") or [] if card.get("parent") and card.get("id")))


class HttpLoadedAdapters:
    def __init__(self, timeout: float = 2.0, port: int = HTTP_PORT, api_key: str = ""):
        self.timeout = timeout
        self.port = port
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def _one(self, client, pod: PodView) -> tuple[str, tuple[str, ...] | str]:
        if not pod.ip:
            return pod.name, "no pod IP yet"
        try:
            response = await client.get(f"http://{pod.ip}:{self.port}/v1/models")
            response.raise_for_status()
            return pod.name, adapters_in(response.json())
        except Exception as err:  # noqa: BLE001 (any failure means "not known to be loaded"; the reason is shown)
            return pod.name, f"GET /v1/models failed: {type(err).__name__}: {err}".rstrip(": ")

    async def observe(self, pods: Sequence[PodView]) -> Observed:
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:
            results = await asyncio.gather(*(self._one(client, p) for p in pods))
        return Observed({n: r for n, r in results if isinstance(r, tuple)},
                        {n: r for n, r in results if isinstance(r, str)})
