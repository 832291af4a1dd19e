"""Polls every endpoint's /health, /metrics and /v1/models on a short interval, with timeouts.

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
                 client: httpx.AsyncClient | None = None) -> None:
        self.pool = pool
        self.interval = interval
        self.client = client or httpx.AsyncClient(timeout=timeout)

    async def scrape(self, endpoint: Endpoint) -> bool:
        started = time.monotonic()  # requests dispatched from now on are not in what this scrape reads
        try:
            health, metrics, models = await asyncio.gather(
                self.client.get(endpoint.url + "/health"), self.client.get(endpoint.url + "/metrics"),
                self.client.get(endpoint.url + "/v1/models"))
            if health.status_code != 200:
                raise RuntimeError(f"/health answered {health.status_code}")
            metrics.raise_for_status()
            models.raise_for_status()
            cards = models.json().get("data", [])
            state = parse_engine_metrics(metrics.text)
        except Exception as error:  # any failure is the endpoint's, never the gateway's
            if endpoint.consecutive_failures == 0:
                logger.warning("endpoint %s failed a scrape: %s", endpoint.address, error)
            endpoint.record_failure()
            return False
        endpoint.record_scrape(state, frozenset(c["id"] for c in cards),
                               frozenset(c["id"] for c in cards if not c.get("parent")), started=started)
        return True

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(e) for e in self.pool))

    async def run(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        await self.client.aclose()
