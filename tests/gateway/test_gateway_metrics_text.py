"""The scraper's Prometheus-text path (engines that serve only /metrics, as vLLM does): the four series
the picker reads, checked against prometheus_client's own writer and parser, and the whole path against
an engine stand-in that has no /load and answers /metrics chunked."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kubeinfer.gateway.datastore import scraper as scraper_module
from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool, parse_engine_metrics
from kubeinfer.gateway.datastore.metrics_text import read_engine_metrics


def exposition(models=("m1", "m2"), lora_samples=((1.0, "a,b", ""), (5.0, 'we"ird\\,x', "c"), (3.0, "old", ""))):
    """What prometheus_client writes for a vLLM-like engine: several models, histograms, longer names that
    start with the wanted ones, label values needing escapes, several lora_requests_info samples."""
    registry = CollectorRegistry()
    waiting = Gauge("vllm:num_requests_waiting", "w", ["model_name"], registry=registry)
    waiting_reason = Gauge("vllm:num_requests_waiting_by_reason", "w", ["model_name", "reason"], registry=registry)
    running = Gauge("vllm:num_requests_running", "r", ["model_name"], registry=registry)
    kv = Gauge("vllm:kv_cache_usage_perc", "kv", ["model_name"], registry=registry)
    lora = Gauge("vllm:lora_requests_info", "lora", ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                 registry=registry)
    tokens = Counter("vllm:prompt_tokens", "p", ["model_name"], registry=registry)
    ttft = Histogram("vllm:time_to_first_token_seconds", "t", ["model_name"], registry=registry)
    for i, model in enumerate(models):
        waiting.labels(model).set(2 + i)
        waiting_reason.labels(model, "capacity").set(100)
        running.labels(model).set(5 * (i + 1))
        kv.labels(model).set(0.1 * (i + 1))
        tokens.labels(model).inc(1000)
        ttft.labels(model).observe(0.3)
    for value, run, wait in lora_samples:
        lora.labels(run, wait, "4").set(value)
    return generate_latest(registry)


@pytest.mark.parametrize("body", [
    exposition(), exposition(models=()), exposition(lora_samples=()),
    exposition().replace(b"\n", b"\r\n"), exposition().rstrip(b"\n"),
    b'vllm:num_requests_waiting 4 1700000000000\nvllm:num_requests_running{model_name="x"} 2 1700000000000\n',
    b"", b"# HELP vllm:num_requests_waiting nothing here\n# TYPE vllm:num_requests_waiting gauge\n",
])
def test_the_fast_read_equals_prometheus_clients_parser(body):
    assert read_engine_metrics(body) == parse_engine_metrics(body.decode())


def test_the_latest_lora_sample_wins_and_escapes_are_undone():
    state = read_engine_metrics(exposition())
    assert state.running_adapters == {'we"ird\\', "x"} and state.waiting_adapters == {"c"} and state.max_loras == 4
    assert (state.waiting, state.running) == (5, 15) and state.kv_usage == pytest.approx(0.2)


class MetricsOnlyEngine:
    """An engine without /load (404), whose /metrics comes chunked, as a streaming server sends it."""

    def __init__(self, body: bytes, healthy: bool = True) -> None:
        self.body, self.healthy, self.requests = body, healthy, []

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _handle(self, reader, writer):
        try:
            while True:
                path = (await reader.readuntil(b"\r\n\r\n")).split(b" ")[1]
                self.requests.append(path)
                if path == b"/metrics":
                    half = len(self.body) // 2
                    chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (self.body[:half], self.body[half:]) if c)
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
                else:
                    status = 404 if path == b"/load" else 200 if self.healthy else 503
                    writer.write(b"HTTP/1.1 %d X\r\ncontent-length: 2\r\n\r\n{}" % status)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


@pytest.mark.parametrize("off_loop", [False, True])
async def test_the_scraper_reads_a_metrics_only_engine(monkeypatch, off_loop):
    if off_loop:  # every exposition read on the worker thread
        monkeypatch.setattr(scraper_module, "OFF_LOOP_BYTES", 0)
    async with MetricsOnlyEngine(exposition()) as engine:
        pool = EndpointPool()
        pool.set_members([Endpoint(engine.address)])
        scraper = scraper_module.Scraper(pool)
        try:
            endpoint = next(iter(pool))
            for _ in range(3):
                assert await scraper.scrape(endpoint)
            assert endpoint.state == read_engine_metrics(exposition())
            assert engine.requests.count(b"/load") == 1  # asked once, then /health + /metrics
            assert engine.requests.count(b"/metrics") == 3
        finally:
            await scraper.close()


async def test_an_unhealthy_metrics_only_engine_fails_its_scrape():
    async with MetricsOnlyEngine(exposition(), healthy=False) as engine:
        pool = EndpointPool()
        pool.set_members([Endpoint(engine.address)])
        scraper = scraper_module.Scraper(pool)
        try:
            endpoint = next(iter(pool))
            assert not await scraper.scrape(endpoint)
            assert endpoint.consecutive_failures == 1
        finally:
            await scraper.close()
