"""The proxy under injected engine faults: fake engines on loopback sockets that refuse, reset, stall or
answer "not here", and the gateway's answers, retries and metrics for each."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from fake_http import read_request, respond

from kubeinfer.gateway.app import Gateway, GatewayConfig
from kubeinfer.gateway.handlers.upstream import UpstreamConfig


class FakeEngine:
    """Answers /health, /metrics and /v1/models like an engine serving `models`; every POST runs
    `on_post(writer)`, the fault under test."""

    def __init__(self, models=("base",), on_post=None) -> None:
        self.models, self.on_post, self.posts = list(models), on_post, 0

    async def __aenter__(self) -> "FakeEngine":
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.address = "127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    def cards(self) -> bytes:
        return json.dumps({"object": "list", "data": [
            {"id": m, "object": "model", "created": 1700000000, "owned_by": "kubeinfer", "root": f"/models/{m}",
             "parent": None if i == 0 else self.models[0], "max_model_len": 512} for i, m in enumerate(self.models)]}
        ).encode()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                method, path, _, _ = await read_request(reader)
                if method == b"POST":
                    self.posts += 1
                    await self.on_post(writer)
                    return
                if path == b"/load":  # the compact load report the gateway polls
                    body = json.dumps({"ready": True, "waiting": 0, "running": 0, "kv_usage": 0.0, "models": self.models,
                                       "running_adapters": [], "waiting_adapters": [], "max_loras": 4}).encode()
                else:
                    body = self.cards() if path == b"/v1/models" else b""
                await respond(writer, 200, body)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def answer_ok(writer) -> None:
    await respond(writer, 200, json.dumps({"choices": [{"text": "ok"}]}).encode())


async def drop_connection(writer) -> None:
    writer.transport.abort()  # took the request, then died: a reset before any response byte


async def stall(writer) -> None:
    await asyncio.sleep(30)


async def queue_full(writer) -> None:
    await respond(writer, 429, json.dumps({"error": {"message": "queue full", "code": 429}}).encode(),
                  "retry-after: 7\r\n")


async def adapter_not_loaded(writer) -> None:
    await respond(writer, 404, json.dumps({"error": {"message": "The model `sql` does not exist.", "type":
                                                     "NotFoundError", "param": "model", "code": 404}}).encode())


async def start_gateway(addresses, **upstream) -> Gateway:
    gateway = Gateway(GatewayConfig(host="127.0.0.1", port=0, ext_proc_port=None, metrics_port=0,
                                    endpoints=[f"http://{a}" for a in addresses], scrape_interval=0.1,
                                    upstream=UpstreamConfig(**upstream)))
    await gateway.start()
    return gateway


async def post(gateway, model="base", **body) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(f"http://127.0.0.1:{gateway.ports['proxy']}/v1/completions",
                               json={"model": model, "prompt": "hi", **body}, timeout=30)


async def gateway_metrics(gateway) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"http://127.0.0.1:{gateway.ports['metrics']}/metrics")).text


@pytest.mark.parametrize("fault", [drop_connection, stall, queue_full])
async def test_a_failure_before_the_first_byte_moves_the_request_to_another_pod(fault):
    async with FakeEngine(on_post=fault) as bad, FakeEngine(on_post=answer_ok) as good:
        gateway = await start_gateway([bad.address, good.address], first_byte_timeout=0.5)
        try:
            for _ in range(40):  # equal pods: chance picks, until the bad one has been tried twice
                response = await post(gateway)
                assert response.status_code == 200, response.text
                assert response.headers["x-gateway-destination-endpoint"] == good.address
                if bad.posts >= 2:
                    break
            assert bad.posts >= 2
            reason = {drop_connection: "transport", stall: "first_byte_timeout", queue_full: "status_429"}[fault]
            assert f'kubeinfer_gateway_retries_total{{reason="{reason}"}} {float(bad.posts)}' in await gateway_metrics(gateway)
        finally:
            await gateway.stop()


async def test_when_every_pod_fails_the_answer_names_each_cause():
    async with FakeEngine(on_post=drop_connection) as a, FakeEngine(on_post=stall) as b:
        gateway = await start_gateway([a.address, b.address], first_byte_timeout=0.5)
        try:
            response = await post(gateway)
            message = response.json()["error"]["message"]
            assert response.status_code == 504  # one of them held the request past the first-byte timeout
            assert a.address in message and b.address in message and "FirstByteTimeout" in message
            assert (a.posts, b.posts) == (1, 1)  # each pod tried once, never the same twice
        finally:
            await gateway.stop()


async def test_an_engine_refusal_everywhere_reaches_the_client_with_its_retry_after():
    async with FakeEngine(on_post=queue_full) as a, FakeEngine(on_post=queue_full) as b:
        gateway = await start_gateway([a.address, b.address])
        try:
            response = await post(gateway)
            assert response.status_code == 429 and response.headers["retry-after"] == "7"
            assert (a.posts, b.posts) == (1, 1)
        finally:
            await gateway.stop()


async def test_a_silent_stream_ends_with_an_error_event_after_the_idle_timeout():
    async def two_chunks_then_silence(writer) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        chunk = b'data: {"choices": [{"text": "a", "index": 0}]}\n\n'
        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await writer.drain()
        await asyncio.sleep(30)

    async with FakeEngine(on_post=two_chunks_then_silence) as engine:
        gateway = await start_gateway([engine.address], idle_timeout=0.5)
        try:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.ports['proxy']}/v1", api_key="x",
                                        max_retries=0)
            stream = await client.completions.create(model="base", prompt="hi", stream=True)
            with pytest.raises(openai.APIError, match="mid-stream"):
                async for _ in stream:
                    pass
            assert 'inference_model_request_error_total{error_code="502",model_name="base"} 1.0' in \
                await gateway_metrics(gateway)
        finally:
            await gateway.stop()


async def test_a_client_that_leaves_before_the_answer_is_a_cancellation_not_an_error():
    async with FakeEngine(on_post=stall) as engine:
        gateway = await start_gateway([engine.address])
        try:
            with pytest.raises(httpx.ReadTimeout):
                await _post_with_timeout(gateway, 0.3)  # the client gives up while the engine is silent
            await asyncio.sleep(0.3)
            metrics = await gateway_metrics(gateway)
            assert 'kubeinfer_gateway_requests_cancelled_total{model_name="base"} 1.0' in metrics
            assert "inference_model_request_error_total{" not in metrics
            assert gateway.pool.endpoints[engine.address].num_unseen == 0  # no longer counted as load
        finally:
            await gateway.stop()


async def _post_with_timeout(gateway, seconds: float) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(f"http://127.0.0.1:{gateway.ports['proxy']}/v1/completions",
                               json={"model": "base", "prompt": "hi"}, timeout=seconds)


async def test_an_adapter_a_pod_failed_to_load_goes_to_the_pod_that_has_it():
    """Placement says both pods hold `sql`; one failed to load it (its /v1/models does not list it)."""
    async with FakeEngine(models=("base",), on_post=adapter_not_loaded) as failed, \
            FakeEngine(models=("base", "sql"), on_post=answer_ok) as loaded:
        gateway = await start_gateway([failed.address, loaded.address])
        try:
            for endpoint in gateway.pool:
                endpoint.placed_adapters = frozenset({"sql"})
            for _ in range(4):
                response = await post(gateway, model="sql")
                assert response.status_code == 200 and response.headers["x-gateway-destination-endpoint"] == \
                    loaded.address
            assert failed.posts == 0  # observed state decides, not the annotation
        finally:
            await gateway.stop()


async def test_a_404_for_an_adapter_moves_the_request_to_another_assigned_pod():
    """Nobody lists `sql` yet: both assigned pods are candidates; one answers 404 (its load failed)."""
    async with FakeEngine(models=("base",), on_post=adapter_not_loaded) as failed, \
            FakeEngine(models=("base",), on_post=answer_ok) as loading:
        gateway = await start_gateway([failed.address, loading.address])
        try:
            for endpoint in gateway.pool:
                endpoint.placed_adapters = frozenset({"sql"})
            for _ in range(30):  # equal pods: chance picks the failed one first sooner or later
                response = await post(gateway, model="sql")
                assert response.status_code == 200, response.text
            assert failed.posts == 1  # after its 404 it is not asked for `sql` again until it lists it
            assert 'kubeinfer_gateway_retries_total{reason="status_404"}' in await gateway_metrics(gateway)
        finally:
            await gateway.stop()


async def test_client_chosen_model_names_do_not_become_label_values():
    async with FakeEngine(on_post=answer_ok) as engine:
        gateway = await start_gateway([engine.address])
        try:
            for i in range(5):
                assert (await post(gateway, model=f"made-up-{i}")).status_code == 404
            metrics = await gateway_metrics(gateway)
            assert "made-up" not in metrics
            assert 'inference_model_request_error_total{error_code="404",model_name="unknown"} 5.0' in metrics
        finally:
            await gateway.stop()


async def test_pick_series_of_departed_endpoints_are_removed():
    async with FakeEngine(on_post=answer_ok) as a, FakeEngine(on_post=answer_ok) as b:
        gateway = await start_gateway([a.address, b.address])
        try:
            for _ in range(40):  # equal pods: chance picks, until a has been picked once
                response = await post(gateway)
                if response.headers["x-gateway-destination-endpoint"] == a.address:
                    break
            assert a.address in await gateway_metrics(gateway)
            gateway.pool.set_members([e for e in gateway.pool if e.address == b.address])
            gateway._forget_departed()  # what discovery calls on a membership change
            assert a.address not in await gateway_metrics(gateway)
        finally:
            await gateway.stop()


async def test_models_through_the_gateway_are_the_engines_cards():
    async with FakeEngine(models=("base", "sql"), on_post=answer_ok) as engine:
        gateway = await start_gateway([engine.address])
        try:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.ports['proxy']}/v1", api_key="x",
                                        max_retries=0)
            # the engines' cards, but no filesystem path: `root` is the served name (issue #34)
            expected = {c["id"]: {**c, "root": c["id"]} for c in json.loads(engine.cards())["data"]}
            async with httpx.AsyncClient() as http:
                listed = (await http.get(f"http://127.0.0.1:{gateway.ports['proxy']}/v1/models")).json()["data"]
            assert {c["id"]: c for c in listed} == expected  # created, owned_by, root, parent, max_model_len
            assert [m.created for m in (await client.models.list()).data] == [1700000000, 1700000000]
            sql = await client.models.retrieve("sql")
            assert (sql.parent, sql.root, sql.max_model_len) == ("base", "sql", 512)
            with pytest.raises(openai.NotFoundError):
                await client.models.retrieve("nope")
            async with httpx.AsyncClient() as http:  # unknown methods: 404 in OpenAI's shape (issue 33), as OpenAI does
                wrong = await http.delete(f"http://127.0.0.1:{gateway.ports['proxy']}/v1/models/sql")
            assert wrong.status_code == 404 and wrong.json()["error"]["code"] == 404
        finally:
            await gateway.stop()
