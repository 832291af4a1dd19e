"""Polls every endpoint's /health and /metrics on a short interval, and /v1/models less often, with timeouts.

Load changes by the millisecond; which models a pod serves changes when an adapter is loaded or
unloaded. So /v1/models is read on the first scrape, then every `models_interval`, and at once when the
metrics name an adapter the gateway has not seen there (one just loaded).

A failed or non-ready poll counts against the endpoint; after `max_failures` in a row the picker stops
choosing it (and it comes back with the first good poll). An endpoint that merely stops answering goes
stale and is dropped by the picker's staleness bound even before that.
"""
from __future__ import annotations

import asyncio
import logging
import time

import httpx

from .endpoints import Endpoint, EndpointPool, parse_engine_metrics

logger = logging.getLogger(__name__)


class Scraper:
    def __init__(self, pool: EndpointPool, interval: float = 0.25, timeout: float = 1.0,
                 client: httpx.AsyncClient | None = None, models_interval: float = 1.0) -> None:
        self.pool = pool
        self.interval = interval
        self.models_interval = models_interval
        self.client = client or httpx.AsyncClient(timeout=timeout)
        self._models_read: dict[str, float] = {}  # address -> when its /v1/models was last read

    async def scrape(self, endpoint: Endpoint) -> bool:
        started = time.monotonic()  # requests dispatched from now on are not in what this scrape reads
        try:
            health, metrics = await asyncio.gather(self.client.get(endpoint.url + "/health"),
                                                   self.client.get(endpoint.url + "/metrics"))
            if health.status_code != 200:
                raise RuntimeError(f"/health answered {health.status_code}")
            metrics.raise_for_status()
            state = parse_engine_metrics(metrics.text)
            models, base_models = endpoint.models, endpoint.base_models
            if self._models_due(endpoint, state, started):
                response = await self.client.get(endpoint.url + "/v1/models")
                response.raise_for_status()
                cards = response.json().get("data", [])
                models = frozenset(c["id"] for c in cards)
                base_models = frozenset(c["id"] for c in cards if not c.get("parent"))
                self._models_read[endpoint.address] = started
        except Exception as error:  # any failure is the endpoint's, never the gateway's
            if endpoint.consecutive_failures == 0:
                logger.warning("endpoint %s failed a scrape: %s", endpoint.address, error)
            endpoint.record_failure()
            self._models_read.pop(endpoint.address, None)  # after a failure, read everything again
            return False
        endpoint.record_scrape(state, models, base_models, started=started)
        return True

    def _models_due(self, endpoint: Endpoint, state, now: float) -> bool:
        last = self._models_read.get(endpoint.address)
        unseen_adapter = not (state.running_adapters | state.waiting_adapters) <= endpoint.models
        return last is None or now - last >= self.models_interval or unseen_adapter

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(e) for e in self.pool))

    async def run(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        await self.client.aclose()
