"""The proxy relays whatever the engine answers (status, body, headers minus hop-by-hop ones, each header
once) and takes only the inference routes (kubeinfer/gateway/handlers/routes.py): anything else is answered by the
gateway in OpenAI's shape, checked with the official openai client where it has an opinion."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from fake_http import read_request

from kubeinfer.gateway.app import Gateway, GatewayConfig
from kubeinfer.gateway.handlers.extproc import ExternalProcessor
from kubeinfer.gateway.handlers.routes import route_of

ENGINE_404 = {"error": {"message": "Not Found", "type": "NotFoundError", "param": None, "code": 404}}


class ScriptedEngine:
    """An engine serving model `base` whose every POST gets `answers[path]` (status, extra header lines,
    body); it records the paths it was asked."""

    def __init__(self, answers: dict[bytes, tuple[int, str, bytes]]) -> None:
        self.answers, self.posted = answers, []

    async def __aenter__(self) -> ScriptedEngine:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _handle(self, reader, writer) -> None:
        try:
            while True:
                method, path, _, _ = await read_request(reader)
                if method == b"POST":
                    self.posted.append(path)
                    status, extra, body = self.answers.get(path.partition(b"?")[0], (404, "", json.dumps(ENGINE_404).encode()))
                elif path == b"/load":
                    status, extra, body = 200, "", json.dumps({
                        "ready": True, "waiting": 0, "running": 0, "kv_usage": 0.0, "models": ["base"],
                        "running_adapters": [], "waiting_adapters": [], "max_loras": 4}).encode()
                else:
                    status, extra, body = 200, "", json.dumps({"object": "list", "data": [
                        {"id": "base", "object": "model", "created": 1, "owned_by": "kubeinfer", "root": "/m",
                         "parent": None}]}).encode()
                # Like uvicorn: the engine's own date and server headers, which must not reach the client twice.
                writer.write(b"HTTP/1.1 %d X\r\ndate: Tue, 01 Jan 2030 00:00:00 GMT\r\nserver: engine\r\n"
                             b"content-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
                             % (status, len(body), extra.encode(), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client closed, or the test ended
        finally:
            writer.close()


async def start_gateway(*addresses: str, **config) -> Gateway:
    gateway = Gateway(GatewayConfig(host="127.0.0.1", port=0, ext_proc_port=None, metrics_port=None,
                                    endpoints=[f"http://{a}" for a in addresses], scrape_interval=0.1, **config))
    await gateway.start()
    return gateway


def url(gateway: Gateway) -> str:
    return f"http://127.0.0.1:{gateway.ports['proxy']}"


def assert_single_headers(response: httpx.Response) -> None:
    names = [k.lower() for k, _ in response.headers.multi_items()]
    assert len(names) == len(set(names)), f"repeated headers: {response.headers.multi_items()}"


@pytest.mark.parametrize("path", [b"/v1/responses", b"/v1/completions"])
async def test_an_engine_404_is_relayed_intact_not_a_dropped_connection(path):
    """Before: the 404 was read as a refusal, judged final, then relayed from a consumed stream
    (httpx.StreamConsumed): the client saw its connection drop."""
    async with ScriptedEngine({}) as a, ScriptedEngine({}) as b:
        gateway = await start_gateway(a.address, b.address)
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                response = await http.post(url(gateway) + path.decode(), json={"model": "base", "input": "hi"})
            assert response.status_code == 404 and response.json() == ENGINE_404
            assert_single_headers(response)
            assert len(a.posted) + len(b.posted) == 1  # an unknown route is not tried on every pod
        finally:
            await gateway.stop()


async def test_a_418_is_relayed_with_its_body_and_headers_once_each():
    teapot = json.dumps({"error": {"message": "short and stout", "type": "Teapot", "param": None, "code": 418}})
    async with ScriptedEngine({b"/v1/chat/completions": (
            418, "x-engine-note: brewed\r\nconnection: keep-alive, x-hop\r\nx-hop: private\r\n", teapot.encode())}) as e:
        gateway = await start_gateway(e.address)
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                response = await http.post(url(gateway) + "/v1/chat/completions",
                                           json={"model": "base", "messages": [{"role": "user", "content": "hi"}]})
            assert response.status_code == 418 and response.text == teapot
            assert response.headers["x-engine-note"] == "brewed" and response.headers["server"] != "engine"
            assert "x-hop" not in response.headers  # named by the engine's Connection header: hop-by-hop
            assert_single_headers(response)
            assert e.posted == [b"/v1/chat/completions"]  # a 418 is not retried
        finally:
            await gateway.stop()


async def test_responses_are_forwarded_like_chat(tmp_path):
    """Routed by the body's `model`, its usage (the Responses API's names) accounted like a chat's."""
    answer = json.dumps({"id": "resp_1", "object": "response", "status": "completed", "model": "base",
                         "output": [], "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5,
                                                 "input_tokens_details": {"cached_tokens": 1}}})
    log = tmp_path / "usage.jsonl"
    async with ScriptedEngine({b"/v1/responses": (200, "", answer.encode())}) as e:
        gateway = await start_gateway(e.address, usage_log=str(log))
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                response = await http.post(url(gateway) + "/v1/responses?x=1", json={"model": "base", "input": "hi"})
                unknown_model = await http.post(url(gateway) + "/v1/responses", json={"model": "nope", "input": "hi"})
            assert response.status_code == 200 and response.json()["id"] == "resp_1"
            assert response.headers["x-gateway-destination-endpoint"] == e.address
            assert e.posted == [b"/v1/responses?x=1"]
            assert unknown_model.status_code == 404  # routed: the picker knows no such model
        finally:
            await gateway.stop()
        line = json.loads(log.read_text().splitlines()[0])
        assert (line["model"], line["prompt_tokens"], line["cached_tokens"], line["completion_tokens"]) == \
            ("base", 3, 1, 2)


def test_a_responses_stream_reports_its_usage_in_the_completed_event():
    from kubeinfer.gateway.handlers.request_info import prompt_text
    from kubeinfer.gateway.flowcontrol.usage import UsageScanner, token_counts

    scanner = UsageScanner()
    usage = {"input_tokens": 7, "output_tokens": 4, "input_tokens_details": {"cached_tokens": 0}}
    for event in ({"type": "response.output_text.delta", "delta": "hi"},
                  {"type": "response.completed", "response": {"model": "base", "usage": usage}}):
        scanner.feed(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
    assert token_counts(scanner.finish()) == (7, 0, 4)
    assert prompt_text({"input": "hello", "instructions": "be brief"}) == "<system>be brief<user>hello"
    assert prompt_text({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}]}) == "<user>a"


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE", "PUT", "PATCH"])
async def test_unknown_routes_and_methods_are_404_in_openai_shape(method):
    async with ScriptedEngine({}) as e:
        gateway = await start_gateway(e.address)
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                for path in ("/v1/anything", "/v1/completions/", "/metrics", "/load", "/v1/embeddings",
                             "/v1/chat/completions" if method != "POST" else "/tokenize"):
                    response = await http.request(method, url(gateway) + path, json={"model": "base"})
                    assert response.status_code == 404, (method, path, response.text)
                    error = response.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 404
                    assert error["type"] == "NotFoundError"
            assert e.posted == []  # never forwarded
        finally:
            await gateway.stop()


async def test_adapter_management_is_refused_with_403_naming_the_operator():
    async with ScriptedEngine({}) as e:
        gateway = await start_gateway(e.address)
        try:
            client = openai.AsyncOpenAI(base_url=url(gateway) + "/v1", api_key="x", max_retries=0)
            for path in ("/load_lora_adapter", "/unload_lora_adapter"):
                with pytest.raises(openai.PermissionDeniedError) as refused:
                    await client.post(path, body={"lora_name": "x", "lora_path": "/etc"}, cast_to=object)
                assert "operator" in refused.value.message
            with pytest.raises(openai.NotFoundError):
                await client.post("/anything", body={"model": "base"}, cast_to=object)
            models = await client.models.list()
            assert [m.id for m in models.data] == ["base"]
            assert (await client.models.retrieve("base")).id == "base"
            await client.close()
            assert e.posted == []
        finally:
            await gateway.stop()


def test_the_route_table():
    assert route_of("POST", "/v1/completions").kind == "inference"
    assert route_of("post", "/v1/chat/completions?x=1").kind == "inference"
    assert route_of("POST", "/v1/responses").kind == "inference"
    assert route_of("GET", "/v1/models").kind == "models"
    assert route_of("GET", "/v1/models/org/name").kind == "model"
    assert route_of("GET", "/v1/models/").status == 404
    assert route_of("POST", "/v1/load_lora_adapter").status == 403
    assert route_of("GET", "/v1/unload_lora_adapter").status == 403
    for method, path in [("GET", "/v1/completions"), ("POST", "/v1/models"), ("POST", "/v1/%63ompletions"),
                         ("POST", "/v1/completions/../load_lora_adapter"), ("GET", "/health"), ("POST", "/")]:
        assert route_of(method, path).status == 404, (method, path)


@pytest.mark.parametrize(("method", "path", "status"), [("POST", "/v1/load_lora_adapter", 403),
                                                         ("GET", "/metrics", 404), ("DELETE", "/v1/anything", 404)])
async def test_ext_proc_refuses_what_is_not_an_inference_route(method, path, status):
    from kubeinfer.gateway.datastore.endpoints import EndpointPool
    from kubeinfer.gateway.scheduling.picker import Picker
    from kubeinfer.gateway.handlers.routing import Router

    processor = ExternalProcessor(Router(Picker(EndpointPool())))
    message = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":method", raw_value=method.encode()),
        base_pb2.HeaderValue(key=":path", raw_value=path.encode())])))

    async def messages():
        yield message
    replies = [r async for r in processor.Process(messages(), None)]
    assert len(replies) == 1 and replies[0].immediate_response.status.code == status
    assert json.loads(replies[0].immediate_response.body)["error"]["code"] == status
