"""Polls every endpoint's load on a short interval, and /v1/models less often, with timeouts.

Load comes from the engine's compact `/load` report when it has one (load_poller.py: one small
request on a kept-alive connection, which also says whether the pod is ready and which models it
serves), else from `/health` and `/metrics` (any vLLM-compatible engine) on the same kind of
connection, of which only the picker's four series are read (metrics_text.py): a large exposition
on a worker thread, so that it never holds up routing on the event loop.

Load changes by the millisecond; which models a pod serves changes when an adapter is loaded or
unloaded. So /v1/models is read on the first scrape, then every `models_interval`, and at once when the
metrics name an adapter the gateway has not seen there (one just loaded).

A pod that joins the pool is polled within `MEMBERSHIP_POLL`, not at the next round: a request held
for a model scaled to zero waits for exactly that pod.

A failed or non-ready poll counts against the endpoint; after `max_failures` in a row the picker stops
choosing it (and it comes back with the first good poll). An endpoint that merely stops answering goes
stale and is dropped by the picker's staleness bound even before that.
"""
from __future__ import annotations

import asyncio
import logging
import time

import httpx

from .endpoints import Endpoint, EndpointPool, EngineState
from .engine_auth import engine_authorization, without_paths
from .http_client import describe, make_client
from .load_poller import LoadConnection, LoadReportUnsupported
from .metrics_text import read_engine_metrics

logger = logging.getLogger(__name__)
# How soon a pod that joins the pool is polled, rather than at the next round: a held request waits on it.
MEMBERSHIP_POLL = 0.02
# An exposition larger than this is read on a worker thread. Below it the read takes less than the
# thread hop would (10 kB: 31 us; 437 kB, forty models' histograms: 0.57 ms, measured on this machine).
OFF_LOOP_BYTES = 64 << 10


class Scraper:
    def __init__(self, pool: EndpointPool, interval: float = 0.25, timeout: float = 1.0,
                 client: httpx.AsyncClient | None = None, models_interval: float = 1.0,
                 engine_api_key: str | None = None) -> None:
        self.pool = pool
        self.auth = engine_authorization(engine_api_key)  # /load and /v1/models take the engines' key
        self.interval = interval
        self.models_interval = models_interval
        self.timeout = timeout
        self.fixed = client  # tests hand in one client (a mock transport)
        # One small pool per endpoint: httpcore scans every connection of a pool on each request, so one
        # pool for 500 endpoints' scrapes would cost O(endpoints) per request (upstream.py).
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._load: dict[str, LoadConnection] = {}
        self._no_load_report: set[str] = set()  # addresses of engines without /load: /health + /metrics
        self._models_read: dict[str, float] = {}  # address -> when its /v1/models was last read

    async def scrape(self, endpoint: Endpoint) -> bool:
        started = time.monotonic()  # requests dispatched from now on are not in what this scrape reads
        try:
            state, reported_models = await self.read_load(endpoint)
            models, base_models, cards = endpoint.models, endpoint.base_models, None
            if reported_models is not None:  # the report names the models: read their cards when they change
                due = (endpoint.address not in self._models_read or endpoint.models_stale
                       or reported_models != endpoint.models)
            else:
                due = self._models_due(endpoint, state, started)
            if due:
                models, base_models, cards = await self.read_models(endpoint)
                self._models_read[endpoint.address] = started
        except Exception as error:  # any failure is the endpoint's, never the gateway's
            if endpoint.consecutive_failures == 0:
                logger.warning("endpoint %s failed a scrape: %s", endpoint.address, describe(error))
            endpoint.record_failure()
            self._models_read.pop(endpoint.address, None)  # after a failure, read everything again
            return False
        endpoint.record_scrape(state, models, base_models, started=started, cards=cards)
        return True

    async def read_load(self, endpoint: Endpoint) -> tuple[EngineState, frozenset[str] | None]:
        """(load, the models the report names, None without /load)."""
        if self.fixed is not None:  # tests: a mock transport
            health, metrics = await asyncio.gather(self.fixed.get(endpoint.url + "/health"),
                                                   self.fixed.get(endpoint.url + "/metrics"))
            return self._prometheus_state(health.status_code, metrics.status_code, metrics.content)
        connection = self._load.get(endpoint.address)
        if connection is None:
            host, _, port = endpoint.address.rpartition(":")
            connection = self._load[endpoint.address] = LoadConnection(host.strip("[]"), int(port),
                                                                           self.auth.get("authorization"))
        async with asyncio.timeout(self.timeout):
            if endpoint.address not in self._no_load_report:
                try:
                    state, report = await connection.read()
                    return state, frozenset(report["models"])
                except LoadReportUnsupported:
                    self._no_load_report.add(endpoint.address)
            health, _ = await connection.get("/health")
            metrics, body = await connection.get("/metrics")
        if health == 200 and metrics == 200 and len(body) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(read_engine_metrics, body), None
        return self._prometheus_state(health, metrics, body)

    @staticmethod
    def _prometheus_state(health: int, metrics: int, body: bytes) -> tuple[EngineState, None]:
        if health != 200:
            raise RuntimeError(f"/health answered {health}")
        if metrics != 200:
            raise RuntimeError(f"/metrics answered {metrics}")
        return read_engine_metrics(body), None

    async def read_models(self, endpoint: Endpoint) -> tuple[frozenset[str], frozenset[str], dict[str, dict]]:
        """(loaded model ids, base model ids, cards by id) from the pod's /v1/models."""
        response = await self.client_for(endpoint.address).get(endpoint.url + "/v1/models", headers=self.auth)
        response.raise_for_status()
        cards = {c["id"]: without_paths(c) for c in response.json().get("data", [])}
        return frozenset(cards), frozenset(i for i, c in cards.items() if not c.get("parent")), cards

    def _models_due(self, endpoint: Endpoint, state, now: float) -> bool:
        last = self._models_read.get(endpoint.address)
        unseen_adapter = not (state.running_adapters | state.waiting_adapters) <= endpoint.models
        return last is None or now - last >= self.models_interval or unseen_adapter or endpoint.models_stale

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(e) for e in self.pool))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.scrape_all()
            polled = set(self.pool.endpoints)
            next_round = loop.time() + self.interval
            while (left := next_round - loop.time()) > 0:
                version = self.pool.version
                await asyncio.sleep(min(MEMBERSHIP_POLL, left))
                if self.pool.version != version:  # a pod joined (a promotion, a scale-up): poll it now
                    joined = [e for address, e in self.pool.endpoints.items() if address not in polled]
                    polled.update(e.address for e in joined)
                    await asyncio.gather(*(self.scrape(e) for e in joined))

    def client_for(self, address: str) -> httpx.AsyncClient:
        if self.fixed is not None:
            return self.fixed
        if address not in self._clients:
            self._clients[address] = make_client(self.timeout)
        return self._clients[address]

    def retain_only(self, members: set[str]) -> None:
        """Close the pools of endpoints that left (in the background: discovery calls this synchronously)."""
        for address in [a for a in self._clients if a not in members]:
            asyncio.ensure_future(self._clients.pop(address).aclose())
        for address in [a for a in self._load if a not in members]:
            self._load.pop(address).close()
            self._no_load_report.discard(address)

    async def close(self) -> None:
        for connection in self._load.values():
            connection.close()
        for client in [*self._clients.values(), *([self.fixed] if self.fixed else [])]:
            await client.aclose()
