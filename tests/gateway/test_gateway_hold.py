"""The gateway's hold queue for models with no ready engine: bounds, timeout, cancellation, arrival
order, and a single capacity request per wake-up."""
from __future__ import annotations

import asyncio

import pytest

from kubeinfer.gateway.flowcontrol.hold import HoldQueue, HoldRefused


class Model:
    def __init__(self) -> None:
        self.up = False
        self.asks = 0
        self.sizes: list[int] = []  # requests held at each ask

    def ready(self, _: str) -> bool:
        return self.up

    async def ask(self, _: str, held: int) -> bool:
        self.asks += 1
        self.sizes.append(held)
        return True


async def test_a_ready_model_is_not_held():
    model = Model()
    model.up = True
    assert await HoldQueue(model.ready, model.ask).wait_until_ready("m") == 0.0 and model.asks == 0


async def test_held_requests_are_released_in_arrival_order_after_one_ask():
    model, order = Model(), []
    queue = HoldQueue(model.ready, model.ask, timeout=5)

    async def request(i: int) -> None:
        await queue.wait_until_ready("m")
        order.append(i)

    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(request(i)))
        await asyncio.sleep(0.01)
    assert queue.held("m") == 5 and model.asks == 1  # one scale-up asked while it is pending
    model.up = True
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4] and queue.held("m") == 0


async def test_a_growing_hold_asks_again_for_more_at_most_once_per_interval(monkeypatch):
    """A wake-up burst: requests keep arriving while nothing is ready. The hold asks again with the
    larger count (the ask sizes the scale-up), but not more often than REASK_SECONDS."""
    from kubeinfer.gateway.flowcontrol import hold as hold_module

    monkeypatch.setattr(hold_module, "REASK_SECONDS", 0.2)
    model = Model()
    queue = HoldQueue(model.ready, model.ask, timeout=5)
    tasks = []
    for _ in range(10):
        tasks.append(asyncio.create_task(queue.wait_until_ready("m")))
        await asyncio.sleep(0.03)
    await asyncio.sleep(0.3)
    assert model.sizes[0] == 1 and model.sizes[-1] == 10 and len(model.sizes) <= 3
    asked = model.asks
    await asyncio.sleep(0.3)
    assert model.asks == asked, "a hold that stopped growing does not ask again"
    model.up = True
    await asyncio.gather(*tasks)


def test_a_wake_up_is_sized_by_the_held_requests_within_the_model_bounds():
    from kubeinfer.gateway.flowcontrol.model_priorities import ScaleTarget, scale_targets_of

    target = scale_targets_of([{"metadata": {"name": "chat", "namespace": "ns"}, "spec": {
        "model": {"uri": "hf://x/y"}, "minReplicas": 0, "maxReplicas": 8,
        "autoscaling": {"targetQueueDepth": 4}}}])["chat"]
    assert [target.replicas_for(n) for n in (1, 4, 5, 30, 1000)] == [1, 1, 2, 8, 8]
    assert ScaleTarget("ns", "plain", min_replicas=2).replicas_for(1000) == 2  # no autoscaling: the minimum


async def test_the_hold_is_bounded_and_times_out():
    model = Model()
    queue = HoldQueue(model.ready, model.ask, max_held=2, timeout=0.3)
    held = [asyncio.create_task(queue.wait_until_ready("m")) for _ in range(2)]
    await asyncio.sleep(0.05)
    with pytest.raises(HoldRefused, match="already waiting"):
        await queue.wait_until_ready("m")
    for task in held:
        with pytest.raises(HoldRefused, match="within 0.3 s"):
            await task
    assert queue.held("m") == 0


async def test_a_client_that_leaves_while_held_leaves_the_queue():
    model = Model()
    queue = HoldQueue(model.ready, model.ask, timeout=5)
    task = asyncio.create_task(queue.wait_until_ready("m"))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert queue.held("m") == 0


async def test_a_new_wake_up_asks_again_after_the_model_was_ready():
    model = Model()
    queue = HoldQueue(model.ready, model.ask, timeout=5)
    first = asyncio.create_task(queue.wait_until_ready("m"))
    await asyncio.sleep(0.05)
    model.up = True
    await first
    model.up = False  # scaled to zero again
    second = asyncio.create_task(queue.wait_until_ready("m"))
    await asyncio.sleep(0.05)
    assert model.asks == 2
    model.up = True
    await second


async def test_the_proxy_holds_a_request_until_its_engine_is_back(llama_dir):
    """The only engine goes away (scaled to zero, restarting): a request for its model is held, not
    refused, and is served as soon as an engine answers on that address again; the hold is in the metrics."""
    import httpx
    from server_harness import RunningServer
    from test_gateway import proxy_url, start_gateway

    with RunningServer(llama_dir, name="tiny", block_size=8) as engine:
        port = engine.port
        gateway = await start_gateway([engine.url])
    try:
        await asyncio.sleep(0.5)  # the gateway sees the engine gone, and still knows what it served
        assert not gateway.picker.ready_endpoints()
        async with httpx.AsyncClient(timeout=60) as http:
            request = asyncio.create_task(http.post(proxy_url(gateway) + "/v1/completions",
                                                    json={"model": "tiny", "prompt": "Hello", "max_tokens": 2}))
            await asyncio.sleep(0.5)
            assert not request.done() and gateway.router.hold.held("tiny") == 1
            with RunningServer(llama_dir, name="tiny", block_size=8, port=port):
                response = await request
            metrics = (await http.get(f"http://127.0.0.1:{gateway.ports['metrics']}/metrics")).text
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
        assert 'kubeinfer_gateway_hold_duration_seconds_count{model_name="tiny"} 1.0' in metrics
        assert "kubeinfer_gateway_requests_held 0.0" in metrics
    finally:
        await gateway.stop()


async def test_a_held_request_times_out_with_retry_after(llama_dir):
    import httpx
    from server_harness import RunningServer
    from test_gateway import proxy_url, start_gateway

    with RunningServer(llama_dir, name="tiny", block_size=8) as engine:
        gateway = await start_gateway([engine.url])
    gateway.router.hold.timeout = 0.5
    try:
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(timeout=60) as http:
            response = await http.post(proxy_url(gateway) + "/v1/completions",
                                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})
            unknown = await http.post(proxy_url(gateway) + "/v1/completions",
                                      json={"model": "nope", "prompt": "Hello", "max_tokens": 2})
        assert response.status_code == 503 and response.headers["retry-after"]
        assert "within 0.5 s" in response.json()["error"]["message"]
        assert unknown.status_code in (404, 503) and "within" not in unknown.text  # never held: not a known model
    finally:
        await gateway.stop()


async def test_a_pod_that_joins_the_pool_is_polled_at_once_not_at_the_next_round():
    """A promotion adds a pod while requests are held for its model: the scraper polls the newcomer
    within tens of milliseconds, however long its interval (0.31 -> 0.09 s TTFT for a promoted standby
    in benchmarks/bench_scale_from_zero.py)."""
    import json
    import time

    from fake_http import read_request, respond

    from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool
    from kubeinfer.gateway.datastore.scraper import Scraper

    load = json.dumps({"ready": True, "waiting": 0, "running": 0, "kv_usage": 0.0, "running_adapters": [],
                       "waiting_adapters": [], "max_loras": 0, "models": ["tiny"]}).encode()
    models = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model", "root": "tiny",
                                                     "parent": None}]}).encode()

    async def engine(reader, writer):
        try:
            while True:
                _, path, _, _ = await read_request(reader)
                await respond(writer, 200, load if path == b"/load" else models)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    pool = EndpointPool()
    scraper = Scraper(pool, interval=60.0)
    rounds = asyncio.create_task(scraper.run())
    try:
        await asyncio.sleep(0.1)  # the first round (of nobody) is over: the next is a minute away
        joined = Endpoint(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        pool.set_members([joined])
        started = time.monotonic()
        while joined.last_scrape is None and time.monotonic() - started < 5:
            await asyncio.sleep(0.005)
        assert joined.last_scrape is not None and time.monotonic() - started < 1.0
        assert joined.models == {"tiny"}
    finally:
        rounds.cancel()
        await scraper.close()
        server.close()
