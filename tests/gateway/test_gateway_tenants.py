"""Tenants at the gateway: the tenants file and its reload, who a request belongs to (401 otherwise),
each limit (429 naming it, with Retry-After) in proxy and ext_proc modes, the token charge corrected by
the engine's usage, and usage accounting (Prometheus counters with a tenant label, the JSON-lines log).
The fake engine here (`Engine`) is shared with test_gateway_fallback.py."""
from __future__ import annotations

import asyncio
import hashlib
import json

import httpx
import pytest
from fake_http import read_request, respond

from kubeinfer.gateway.app import Gateway, GatewayConfig
from kubeinfer.gateway.scheduling.picker import RoutingError
from kubeinfer.gateway.flowcontrol.tenant_limits import TenantLimits, TokenBucket, estimate_tokens
from kubeinfer.gateway.flowcontrol.tenants import Tenant, TenantDirectory, TenantFileError, parse_tenants
from kubeinfer.gateway.flowcontrol.usage import UsageScanner


class Engine:
    def __init__(self, models=("base",), on_post=None, waiting: float = 0.0) -> None:
        self.models, self.on_post, self.waiting = list(models), on_post or answer_with_usage, waiting
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []  # of each POST, names lower-cased

    async def __aenter__(self) -> Engine:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        self.url = f"http://{self.address}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                method, path, headers, raw = await read_request(reader)
                if method == b"POST":
                    self.headers.append(headers)
                    body = json.loads(raw)
                    self.bodies.append(body)
                    await self.on_post(self, body, writer)
                    return
                if path == b"/load":
                    answer = {"ready": True, "waiting": self.waiting, "running": 0, "kv_usage": 0.0,
                              "models": self.models, "running_adapters": [], "waiting_adapters": [], "max_loras": 4}
                else:
                    answer = {"object": "list", "data": [{"id": m, "object": "model", "created": 1, "owned_by": "x",
                                                          "root": None, "parent": None, "max_model_len": 512}
                                                         for m in self.models]}
                await respond(writer, 200, json.dumps(answer).encode())
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}


async def answer_with_usage(engine: Engine, body: dict, writer) -> None:
    if body.get("stream"):
        events = [{"model": body["model"], "choices": [{"text": "o"}]},
                  {"model": body["model"], "choices": [{"text": "k"}]}]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({"model": body["model"], "choices": [], "usage": USAGE})
        stream = b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in events) + b"data: [DONE]\n\n"
        await respond(writer, 200, stream, content_type="text/event-stream")
        return
    await respond(writer, 200, json.dumps({"model": body["model"], "choices": [{"text": "ok"}],
                                           "usage": USAGE}).encode())


async def stall(engine: Engine, body: dict, writer) -> None:
    await asyncio.sleep(30)


async def drop_connection(engine: Engine, body: dict, writer) -> None:
    writer.transport.abort()


async def start_gateway(engines, **config) -> Gateway:
    gateway = Gateway(GatewayConfig(host="127.0.0.1", port=0, ext_proc_port=None, metrics_port=0,
                                    endpoints=[e.url for e in engines], scrape_interval=0.1, **config))
    await gateway.start()
    return gateway


async def post(gateway, key: str | None = None, model="base", headers=None, **body) -> httpx.Response:
    headers = dict(headers or {})
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    async with httpx.AsyncClient() as http:
        return await http.post(f"http://127.0.0.1:{gateway.ports['proxy']}/v1/completions",
                               json={"model": model, "prompt": "hello there", **body}, headers=headers, timeout=30)


async def metrics_text(gateway) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"http://127.0.0.1:{gateway.ports['metrics']}/metrics")).text


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


TENANTS = f"""
tenants:
  - name: team-a
    apiKeys: [key-a]
    requestsPerSecond: 2
  - name: team-b
    apiKeySha256: [{hashlib.sha256(b"key-b").hexdigest()}]
    tokensPerMinute: 60
  - name: team-c
    apiKeys: [key-c]
    maxConcurrency: 1
"""


def write_tenants(tmp_path, text: str = TENANTS):
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    return str(path)


# -- the tenants file and identification -------------------------------------------------------------
def test_plain_and_hashed_keys_identify_their_tenant_and_others_get_401(tmp_path):
    directory = TenantDirectory(write_tenants(tmp_path))
    assert directory.identify({"authorization": "Bearer key-a"}).name == "team-a"
    assert directory.identify({"authorization": "bearer key-b"}).name == "team-b"
    with pytest.raises(RoutingError) as wrong:
        directory.identify({"authorization": "Bearer nope"})
    assert (wrong.value.status, wrong.value.message) == (401, "Incorrect API key provided.")
    with pytest.raises(RoutingError, match="You didn't provide an API key") as missing:
        directory.identify({})
    assert missing.value.status == 401


def test_the_tenant_header_counts_only_when_trusted_and_a_default_tenant_takes_the_rest(tmp_path):
    path = write_tenants(tmp_path, TENANTS + "defaultTenant: {name: anonymous, requestsPerSecond: 1}\n")
    assert TenantDirectory(path).identify({"x-gateway-tenant": "team-a"}).name == "anonymous"
    trusted = TenantDirectory(path, trust_header=True)
    assert trusted.identify({"x-gateway-tenant": "team-a"}).name == "team-a"
    assert trusted.identify({"authorization": "Bearer nope"}).requests_per_second == 1


@pytest.mark.parametrize("text, error", [
    ("tenants: [{apiKeys: [k]}]", "each tenant needs a name"),
    ("tenants: [{name: a, requestsPerSecond: -1}]", "requestsPerSecond must be a positive number"),
    ("tenants: [{name: a, apiKeys: [k]}, {name: b, apiKeys: [k]}]", "also belongs to 'a'"),
    ("tenants: [{name: a, apiKeySha256: [xyz]}]", "64 hex digits"),
    ("tenants: [{name: a, rps: 3}]", "unknown field(s) rps"),
])
def test_a_broken_tenants_file_says_what_is_wrong(text, error):
    import yaml

    with pytest.raises(TenantFileError, match=error.replace("(", r"\(").replace(")", r"\)")):
        parse_tenants(yaml.safe_load(text))


def test_the_file_is_reloaded_when_it_changes_and_a_broken_one_keeps_the_last_good(tmp_path):
    clock = Clock()
    path = write_tenants(tmp_path)
    directory = TenantDirectory(path, clock=clock)
    write_tenants(tmp_path, "tenants: [{name: team-z, apiKeys: [key-z, longer-key]}]")
    assert directory.identify({"authorization": "Bearer key-a"}).name == "team-a"  # checked at most once a second
    clock.now += 1.5
    assert directory.identify({"authorization": "Bearer key-z"}).name == "team-z"
    with pytest.raises(RoutingError):
        directory.identify({"authorization": "Bearer key-a"})
    write_tenants(tmp_path, "tenants: [{name: broken}, {name: broken}, {name: broken}]")
    clock.now += 1.5
    assert directory.identify({"authorization": "Bearer key-z"}).name == "team-z"


# -- limits --------------------------------------------------------------------------------------------
def test_requests_per_second_refuses_beyond_the_rate_with_the_wait_in_retry_after():
    clock = Clock()
    limits, tenant = TenantLimits(clock=clock), Tenant("a", requests_per_second=2)
    limits.admit(tenant, 10), limits.admit(tenant, 10)
    with pytest.raises(RoutingError) as refused:
        limits.admit(tenant, 10)
    assert refused.value.status == 429 and refused.value.retry_after == 1
    assert refused.value.message == "tenant 'a' is over its requestsPerSecond limit of 2"
    clock.now += 0.5
    limits.admit(tenant, 10)  # refilled one request


def test_tokens_are_charged_by_estimate_and_corrected_by_usage():
    clock = Clock()
    limits, tenant = TenantLimits(clock=clock), Tenant("b", tokens_per_minute=60)  # a token a second
    charge = limits.admit(tenant, 50)
    with pytest.raises(RoutingError) as refused:
        limits.admit(tenant, 20)  # 10 left
    assert refused.value.retry_after == 10
    assert refused.value.message == ("tenant 'b' is over its tokensPerMinute limit of 60 "
                                     "(this request is estimated at 20 tokens)")
    limits.settle(charge, 10)  # it used 10: 40 come back
    limits.admit(tenant, 20)
    limits.settle(charge, 10)  # settling twice changes nothing
    assert limits.state(tenant).tokens.level == pytest.approx(30)


def test_a_request_larger_than_the_bucket_runs_when_the_bucket_is_full_and_leaves_a_debt():
    clock = Clock()
    limits, tenant = TenantLimits(clock=clock), Tenant("b", tokens_per_minute=60)
    limits.admit(tenant, 100)
    with pytest.raises(RoutingError) as refused:
        limits.admit(tenant, 1)
    assert refused.value.retry_after == 41  # 40 tokens of debt and one to take, at a token a second


def test_concurrency_is_bounded_until_a_request_settles():
    limits, tenant = TenantLimits(), Tenant("c", max_concurrency=1)
    charge = limits.admit(tenant, 1)
    with pytest.raises(RoutingError, match="has 1 requests in flight, its maxConcurrency limit of 1"):
        limits.admit(tenant, 1)
    limits.settle(charge, None)
    limits.admit(tenant, 1)


def test_divided_scope_gives_each_replica_its_share():
    clock = Clock()
    limits = TenantLimits("divided", replicas=4, clock=clock)
    state = limits.state(Tenant("a", requests_per_second=8, tokens_per_minute=400, max_concurrency=10))
    assert (state.requests.rate, state.tokens.capacity, state.max_concurrency) == (2, 100, 2)
    with pytest.raises(ValueError, match="replica, divided"):
        TenantLimits("global")


def test_the_estimate_is_prompt_characters_over_four_plus_max_tokens():
    assert estimate_tokens("x" * 40, 16) == 11 + 16
    assert estimate_tokens("", None) == 1 + 256
    assert TokenBucket(1, 5).wait_for(9) == 0  # at most a full bucket is asked


# -- usage in responses -------------------------------------------------------------------------------
def test_usage_is_read_from_a_json_body_and_from_a_stream_split_anywhere():
    whole = UsageScanner()
    for part in (b'{"model": "m", "usage": {"prompt_', b'tokens": 5}}'):
        whole.feed(part)
    assert whole.finish() == {"prompt_tokens": 5}
    stream = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [], "usage": {"completion_tokens": 2}}\n\n'
    stream += b"data: [DONE]\n\n"
    split = UsageScanner()
    for i in range(0, len(stream), 7):
        split.feed(stream[i:i + 7])
    assert split.finish() == {"completion_tokens": 2}
    bare = UsageScanner()
    bare.feed(b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')
    assert bare.finish() is None


# -- through the proxy ---------------------------------------------------------------------------------
async def test_proxy_refuses_unknown_keys_and_each_limit_in_openais_shape(tmp_path):
    async with Engine(on_post=answer_with_usage) as engine:
        gateway = await start_gateway([engine], tenants_file=write_tenants(tmp_path))
        try:
            refused = await post(gateway, "wrong")
            assert refused.status_code == 401
            assert refused.json() == {"error": {"message": "Incorrect API key provided.", "type": "AuthenticationError",
                                                "param": None, "code": 401}}
            assert [(await post(gateway, "key-a")).status_code for _ in range(2)] == [200, 200]
            over = await post(gateway, "key-a")
            assert over.status_code == 429 and over.headers["retry-after"] == "1"
            assert over.json()["error"] == {"message": "tenant 'team-a' is over its requestsPerSecond limit of 2",
                                            "type": "RateLimitError", "param": None, "code": 429}
            # 43 charged, corrected to the 10 used: a stream too, the gateway asks for its usage
            assert (await post(gateway, "key-b", max_tokens=40, stream=True)).status_code == 200
            assert (await post(gateway, "key-b", max_tokens=40)).status_code == 200  # 43 of 50, then 40 left
            tokens = await post(gateway, "key-b", max_tokens=40)
            assert tokens.status_code == 429 and tokens.headers["retry-after"] == "3"  # 43 - 40 at one a second
            assert "over its tokensPerMinute limit of 60" in tokens.json()["error"]["message"]
        finally:
            await gateway.stop()


async def test_proxy_corrects_the_token_charge_to_the_reported_usage(tmp_path):
    async with Engine() as engine:
        gateway = await start_gateway([engine], tenants_file=write_tenants(tmp_path))
        try:
            # each is estimated at 3 + 30 = 33 of 60 tokens; the engine reports 10, so 50 are left after
            # the first, 40 after the second: without the correction the second would be refused
            assert (await post(gateway, "key-b", max_tokens=30)).status_code == 200
            assert (await post(gateway, "key-b", max_tokens=30)).status_code == 200
            # a stream without include_usage is corrected too: the gateway asks the engine for its usage and
            # removes it from what the client gets; 30 are left, not the 7 its estimate would leave
            streamed = await post(gateway, "key-b", max_tokens=30, stream=True)
            assert streamed.status_code == 200 and b'"usage"' not in streamed.content
            assert streamed.content.endswith(b"data: [DONE]\n\n") and streamed.content.count(b"data:") == 3
            assert engine.bodies[-1]["stream_options"] == {"include_usage": True}
            assert (await post(gateway, "key-b", max_tokens=20)).status_code == 200
        finally:
            await gateway.stop()


async def test_proxy_bounds_concurrency_and_frees_the_slot_when_the_response_ends(tmp_path):
    async with Engine(on_post=stall) as engine:
        gateway = await start_gateway([engine], tenants_file=write_tenants(tmp_path))
        try:
            first = asyncio.create_task(post(gateway, "key-c"))
            while not engine.bodies:
                await asyncio.sleep(0.01)
            second = await post(gateway, "key-c")
            assert second.status_code == 429 and second.headers["retry-after"] == "1"
            assert second.json()["error"]["message"] == ("tenant 'team-c' has 1 requests in flight, "
                                                         "its maxConcurrency limit of 1")
            engine.on_post = answer_with_usage
            first.cancel()  # the client leaves: its slot is free
            await asyncio.sleep(0.2)
            assert (await post(gateway, "key-c")).status_code == 200
        finally:
            await gateway.stop()


async def test_usage_is_counted_per_tenant_and_logged_as_json_lines(tmp_path):
    log = tmp_path / "usage.jsonl"
    async with Engine() as engine:
        gateway = await start_gateway([engine], tenants_file=write_tenants(tmp_path), usage_log=str(log))
        try:
            await post(gateway, "key-a")
            await post(gateway, "key-a", stream=True, stream_options={"include_usage": True})
            await post(gateway, "key-a")  # over 2 per second
            await post(gateway, "wrong")
            text = await metrics_text(gateway)
        finally:
            await gateway.stop()
    assert 'kubeinfer_gateway_tenant_requests_total{code="200",model_name="base",tenant="team-a"} 2.0' in text
    assert 'kubeinfer_gateway_tenant_requests_total{code="429",model_name="base",tenant="team-a"} 1.0' in text
    assert 'kubeinfer_gateway_tenant_prompt_tokens_total{model_name="base",tenant="team-a"} 14.0' in text
    assert 'kubeinfer_gateway_tenant_cached_prompt_tokens_total{model_name="base",tenant="team-a"} 8.0' in text
    assert 'kubeinfer_gateway_tenant_completion_tokens_total{model_name="base",tenant="team-a"} 6.0' in text
    assert "wrong" not in text and 'tenant_requests_total{code="401"' not in text  # no tenant, no series
    assert 'inference_model_request_error_total{error_code="401",model_name="base"} 1.0' in text
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(x["tenant"], x["status"], x["prompt_tokens"], x["cached_tokens"], x["completion_tokens"])
            for x in lines] == [("team-a", 200, 7, 4, 3), ("team-a", 200, 7, 4, 3), ("team-a", 429, None, None, None)]
    assert lines[0]["endpoint"] == engine.address and lines[0]["seconds"] >= 0


# -- through ext_proc ----------------------------------------------------------------------------------
def _processor(tmp_path):
    from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool, EngineState
    from kubeinfer.gateway.handlers.extproc import ExternalProcessor
    from kubeinfer.gateway.handlers.metrics import GatewayMetrics
    from kubeinfer.gateway.scheduling.picker import Picker, PickerConfig
    from kubeinfer.gateway.handlers.routing import Router
    from kubeinfer.gateway.flowcontrol.tenant_gate import TenantGate
    from kubeinfer.gateway.flowcontrol.usage import UsageRecorder

    pod = Endpoint("10.0.0.1:8000")
    pod.record_scrape(EngineState(), frozenset({"base"}), frozenset({"base"}))
    pool = EndpointPool()
    pool.set_members([pod])
    picker = Picker(pool, PickerConfig())
    router = Router(picker, GatewayMetrics(picker))
    router.tenants = TenantGate(TenantDirectory(write_tenants(tmp_path)), TenantLimits(),
                                UsageRecorder(router.metrics), router.model_label)
    return ExternalProcessor(router), router


def _request(key: str, body: dict | None = None):
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    headers = [(":method", "POST"), (":path", "/v1/completions"), ("authorization", f"Bearer {key}")]
    return [ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]))),
            ep.ProcessingRequest(request_body=ep.HttpBody(
                body=json.dumps(body or {"model": "base", "prompt": "hi"}).encode(), end_of_stream=True))]


def _response(body: bytes):
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    status = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    return [ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=status)),
            ep.ProcessingRequest(response_body=ep.HttpBody(body=body, end_of_stream=True))]


async def _run(processor, messages):
    async def stream():
        for message in messages:
            yield message
    return [reply async for reply in processor.Process(stream(), None)]


def _immediate(replies) -> tuple[int, dict, dict]:
    answer = replies[-1].immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in answer.headers.set_headers}
    return answer.status.code, headers, json.loads(answer.body)


async def test_ext_proc_refuses_unknown_keys_and_limits_with_retry_after(tmp_path):
    processor, _ = _processor(tmp_path)
    status, headers, body = _immediate(await _run(processor, _request("wrong")))
    assert (status, body["error"]["type"], body["error"]["message"]) == (401, "AuthenticationError",
                                                                         "Incorrect API key provided.")
    for _ in range(2):
        assert not (await _run(processor, _request("key-a")))[-1].HasField("immediate_response")
    status, headers, body = _immediate(await _run(processor, _request("key-a")))
    assert status == 429 and headers["retry-after"] == "1"
    assert body["error"]["message"] == "tenant 'team-a' is over its requestsPerSecond limit of 2"
    costly = {"model": "base", "prompt": "hi", "max_tokens": 40}  # 41 tokens of 60; no response seen: kept
    assert not (await _run(processor, _request("key-b", costly)))[-1].HasField("immediate_response")
    status, headers, body = _immediate(await _run(processor, _request("key-b", costly)))
    assert status == 429 and headers["retry-after"] == "22"  # 41 - 19 tokens at one a second


async def test_ext_proc_holds_the_concurrency_slot_until_the_response_ends_and_counts_usage(tmp_path):
    processor, router = _processor(tmp_path)
    held = asyncio.Event()

    async def open_request():
        for message in _request("key-c"):
            yield message
        await held.wait()  # the response has not begun: the slot is held
        for message in _response(json.dumps({"model": "base", "usage": USAGE}).encode()):
            yield message

    first = asyncio.create_task(_run_stream(processor, open_request()))
    await asyncio.sleep(0.05)
    status, _, body = _immediate(await _run(processor, _request("key-c")))
    assert status == 429 and "maxConcurrency limit of 1" in body["error"]["message"]
    held.set()
    await first
    assert not (await _run(processor, _request("key-c")))[-1].HasField("immediate_response")
    from prometheus_client import generate_latest
    text = generate_latest(router.metrics.registry).decode()
    assert 'kubeinfer_gateway_tenant_completion_tokens_total{model_name="base",tenant="team-c"} 3.0' in text
    assert 'kubeinfer_gateway_tenant_requests_total{code="429",model_name="base",tenant="team-c"} 1.0' in text


async def _run_stream(processor, stream):
    return [reply async for reply in processor.Process(stream, None)]


def test_the_cli_passes_tenant_options_and_stops_on_a_broken_file(tmp_path):
    import argparse

    from kubeinfer.gateway.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--endpoints", "http://e:8000", "--tenants", write_tenants(tmp_path),
                              "--trust-tenant-header", "--tenant-limit-scope", "divided", "--gateway-replicas", "3",
                              "--usage-log", str(tmp_path / "u.jsonl"), "--fallback", "a=b", "--no-fair-queue"])
    config = config_from_args(args)
    assert (config.trust_tenant_header, config.tenant_limit_scope, config.gateway_replicas, config.fallbacks,
            config.fair_queue) == (True, "divided", 3, [("a", "b")], False)
    broken = tmp_path / "broken.yaml"
    broken.write_text("tenants: [{name: a, maxConcurrency: 0}]")
    with pytest.raises(SystemExit, match="maxConcurrency must be a positive number"):
        config_from_args(parser.parse_args(["--endpoints", "http://e:8000", "--tenants", str(broken)]))
