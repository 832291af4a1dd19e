"""Issue #34, the gateway's half of the request path: each finding reproduced on loopback, with a few MB
standing in for hundreds and memory and waiting asserted as bounds."""
from __future__ import annotations

import json

import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from security_helpers import (
    announce_huge_body,
    closed_or_answered,
    half_sent_body,
    half_sent_head,
    json_of,
    send_chunked_until_refused,
    status_of,
    traced_peak,
)
from server_harness import RunningServer
from test_gateway import full_duplex
from test_gateway_tenants import USAGE, Engine, _processor, _request, _response, _run, post, start_gateway, write_tenants

from kubeinfer.gateway.flowcontrol.token_estimate import estimate_request_tokens
from kubeinfer.common.http_guard import GuardConfig

LIMIT = 1 << 20
GUARD = GuardConfig(max_body_bytes=LIMIT, body_read_timeout=1.0, max_concurrent_requests=64)


def proxy(gateway) -> str:
    return f"http://127.0.0.1:{gateway.ports['proxy']}"


# -- finding 1 / 12: the gateway presents the engines' key; engines refuse everyone else ----------------
async def test_the_gateway_presents_the_engine_key_and_shows_no_paths(llama_dir):
    with RunningServer(llama_dir, name="tiny", api_key="engine-key") as engine:
        gateway = await start_gateway([engine], engine_api_key="engine-key")
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                assert (await http.post(engine.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"}
                                        )).status_code == 401  # a pod that goes around the gateway
                answer = await http.post(proxy(gateway) + "/v1/completions",
                                         json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
                assert answer.status_code == 200, answer.text  # /load polled with the key: the pod is ready
                cards = (await http.get(proxy(gateway) + "/v1/models")).json()["data"]
            assert [(c["id"], c["root"]) for c in cards] == [("tiny", "tiny")]  # not the model's directory
        finally:
            await gateway.stop()


async def test_the_client_authorization_is_replaced_by_the_engine_key(tmp_path):
    async with Engine() as engine:
        gateway = await start_gateway([engine], tenants_file=write_tenants(tmp_path), engine_api_key="engine-key")
        try:
            assert (await post(gateway, "key-a")).status_code == 200
        finally:
            await gateway.stop()
    assert engine.headers[-1]["authorization"] == "Bearer engine-key"  # the tenant's key stays at the gateway


async def test_ext_proc_sets_the_engine_key_on_the_routed_request(tmp_path):
    from kubeinfer.gateway.handlers.extproc import ExternalProcessor

    _, router = _processor(tmp_path)
    replies = await _run(ExternalProcessor(router, engine_api_key="engine-key"), _request("key-a"))
    mutation = replies[-1].request_body.response.header_mutation.set_headers
    assert {h.header.key: h.header.raw_value.decode() for h in mutation}["authorization"] == "Bearer engine-key"


# -- finding 4: body limits on the proxy and in ext_proc --------------------------------------------------
async def test_the_proxy_refuses_large_bodies_before_reading_them_with_memory_bounded(tmp_path):
    import asyncio

    async with Engine() as engine:
        gateway = await start_gateway([engine], tenants_file=write_tenants(tmp_path), guard=GUARD)
        try:
            answer = await asyncio.to_thread(announce_huge_body, gateway.ports["proxy"], 300 << 20)
            assert status_of(answer) == 413 and json_of(answer)["error"]["code"] == 413
            with traced_peak() as memory:  # unauthenticated and chunked: counted as it comes
                answer = await asyncio.to_thread(send_chunked_until_refused, gateway.ports["proxy"], 8 * LIMIT)
            assert status_of(answer) == 413
            assert memory["peak"] < 3 * LIMIT
        finally:
            await gateway.stop()
    assert not engine.bodies


async def test_ext_proc_caps_the_body_it_buffers(tmp_path):
    from kubeinfer.gateway.handlers.extproc import ExternalProcessor

    _, router = _processor(tmp_path)
    processor = ExternalProcessor(router, max_body_bytes=LIMIT)
    head = _request("key-a")[0]
    chunk = b"x" * (64 << 10)
    messages = [head, *(ep.ProcessingRequest(request_body=ep.HttpBody(body=chunk, end_of_stream=False))
                        for _ in range(8 * LIMIT // len(chunk)))]
    with traced_peak() as memory:
        replies = await _run(processor, messages)
    refusal = replies[-1].immediate_response
    assert refusal.status.code == 413 and json.loads(refusal.body)["error"]["code"] == 413
    assert len(replies) <= LIMIT // len(chunk) + 2  # refused at the chunk that passed the limit
    assert memory["peak"] < 3 * LIMIT


# -- finding 5: priority is the gateway's --------------------------------------------------------------
async def test_clients_cannot_set_their_own_priority():
    async with Engine() as engine:
        gateway = await start_gateway([engine], forward_priority=True)
        try:
            await post(gateway, priority=-100, headers={"x-gateway-inference-priority": "100"})
        finally:
            await gateway.stop()
    assert engine.bodies[-1]["priority"] == 0  # the gateway's decision, written even when it is 0


async def test_without_forwarding_a_client_priority_is_removed():
    async with Engine() as engine:
        gateway = await start_gateway([engine])
        try:
            await post(gateway, priority=-100)
        finally:
            await gateway.stop()
    assert "priority" not in engine.bodies[-1]


async def test_a_trusted_hop_sets_the_priority_within_its_range():
    async with Engine() as engine:
        gateway = await start_gateway([engine], forward_priority=True, trust_priority_headers=True)
        try:
            await post(gateway, headers={"x-gateway-inference-priority": "7"})
            await post(gateway, headers={"x-gateway-inference-priority": "999999999999"})
            assert (await post(gateway, headers={"x-gateway-inference-priority": "9" * 400})).status_code == 400
        finally:
            await gateway.stop()
    assert [b["priority"] for b in engine.bodies] == [-7, -1_000_000]


# -- finding 6: every request is charged what it may generate, and corrected to what it did ------------
def test_the_estimate_counts_every_prompt_and_every_completion():
    body = {"model": "m", "prompt": ["a" * 40, "b" * 40, [1, 2, 3]], "n": 4, "max_tokens": 100}
    assert estimate_request_tokens(body) == (11 + 11 + 3) + 3 * 4 * 100
    chat = {"model": "m", "messages": [{"role": "user", "content": "x" * 80}], "n": 2, "max_completion_tokens": 5}
    assert estimate_request_tokens(chat) == 21 + 2 * 5
    response = {"model": "m", "instructions": "y" * 40, "max_output_tokens": 900,
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "x" * 40}]},
                          {"type": "function_call_output", "call_id": "c", "output": "z" * 40}]}
    assert estimate_request_tokens(response) == 31 + 900
    assert estimate_request_tokens({"model": "m", "input": "x" * 400}) == 101 + 256


async def test_a_tenant_cannot_exceed_its_token_limit_with_n_and_prompt_lists(tmp_path):
    import asyncio

    from test_gateway_tenants import stall

    async with Engine(on_post=stall) as engine:
        gateway = await start_gateway([engine], tenants_file=write_tenants(tmp_path))
        try:  # team-b: 60 tokens a minute. 2 prompts x 4 completions x 20 tokens: admitted on a full bucket,
            # it leaves the bucket 103 in debt while it runs (charged 21, as one prompt once, it left 39)
            big = asyncio.create_task(post(gateway, "key-b", prompt=["hi", "there"], n=4, max_tokens=20))
            while not engine.bodies:
                await asyncio.sleep(0.01)
            refused = await post(gateway, "key-b", max_tokens=5)
            assert refused.status_code == 429 and "tokensPerMinute" in refused.json()["error"]["message"]
            big.cancel()
        finally:
            await gateway.stop()
    assert len(engine.bodies) == 1


async def test_ext_proc_full_duplex_asks_a_stream_for_usage_and_strips_it(tmp_path):
    processor, router = _processor(tmp_path)
    request = _request("key-b", {"model": "base", "prompt": "hi", "max_tokens": 30, "stream": True})
    replies = await _run(processor, [full_duplex(request[0]), request[1], *_response(
        b'data: {"choices": [{"text": "o"}]}\n\ndata: {"choices": [], "usage": %s}\n\ndata: [DONE]\n\n'
        % json.dumps(USAGE).encode())])
    sent = [r.request_body.response.body_mutation.streamed_response.body for r in replies if r.HasField("request_body")]
    assert json.loads(b"".join(sent))["stream_options"] == {"include_usage": True}
    back = b"".join(r.response_body.response.body_mutation.streamed_response.body for r in replies
                    if r.HasField("response_body"))
    assert back == b'data: {"choices": [{"text": "o"}]}\n\ndata: [DONE]\n\n'
    state = router.tenants.limits.state(router.tenants.directory.tenants.by_name["team-b"])
    assert state.tokens.level == pytest.approx(60 - 10, abs=1)  # corrected to the 10 used, not the 31 estimated


def test_usage_is_read_from_the_tail_of_a_large_body():
    from kubeinfer.gateway.flowcontrol.usage import UsageScanner

    scanner = UsageScanner()
    body = json.dumps({"choices": [{"text": "x" * (6 << 20)}], "usage": USAGE}).encode()
    for i in range(0, len(body), 1 << 16):
        scanner.feed(body[i:i + (1 << 16)])
    assert scanner.finish() == USAGE


# -- finding 8 / 9: time budgets and slowloris on the proxy ------------------------------------------------
async def test_a_huge_timeout_header_is_a_400_not_a_500():
    async with Engine() as engine:
        gateway = await start_gateway([engine])
        try:
            answer = await post(gateway, headers={"x-request-timeout-ms": "1" * 400})
            assert answer.status_code == 400 and "x-request-timeout-ms" in answer.json()["error"]["message"]
        finally:
            await gateway.stop()
    assert not engine.bodies


async def test_half_sent_requests_are_closed_and_excess_ones_refused():
    import asyncio

    guard = GuardConfig(max_body_bytes=LIMIT, body_read_timeout=1.0, max_concurrent_requests=30)
    async with Engine() as engine:
        gateway = await start_gateway([engine], guard=guard, header_read_timeout=0.5)
        port = gateway.ports["proxy"]
        try:
            heads = [half_sent_head(port) for _ in range(50)]
            bodies = [half_sent_body(port) for _ in range(30)]
            await asyncio.sleep(0.2)
            async with httpx.AsyncClient(timeout=10) as http:  # 30 bodies in flight: the limit
                refused = await http.post(proxy(gateway) + "/v1/completions", json={"model": "base", "prompt": "x"})
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                assert (await http.get(proxy(gateway) + "/health")).status_code == 200
            answers = await asyncio.gather(*(asyncio.to_thread(closed_or_answered, s, 10.0) for s in heads + bodies))
            assert all(a is not None for a in answers[:50]), "a half-sent head is still held"
            assert all(a and status_of(a) == 408 for a in answers[50:])
            assert (await post(gateway)).status_code == 200  # the slots came back
        finally:
            for s in heads + bodies:
                s.close()
            await gateway.stop()


def test_the_usage_event_is_stripped_however_the_stream_is_cut():
    from kubeinfer.gateway.handlers.usage_strip import UsageEventStripper

    kept = b'data: {"choices": [{"text": "usage"}], "usage": null}\n\ndata: {"choices": [{"text": "k"}]}\n\n'
    stream = kept + b'data: {"choices": [], "usage": %s}\n\ndata: [DONE]\n\n' % json.dumps(USAGE).encode()
    for size in (1, 7, 64, len(stream)):
        stripper = UsageEventStripper()
        out = b"".join(stripper.feed(stream[i:i + size]) for i in range(0, len(stream), size)) + stripper.flush()
        assert out == kept + b"data: [DONE]\n\n", size


def test_the_keys_come_from_the_environment_the_chart_sets(monkeypatch):
    """The Secret reaches the engines as KUBEINFER_API_KEY and the gateway as KUBEINFER_ENGINE_API_KEY."""
    from kubeinfer.cli import build_parser
    from kubeinfer.gateway.cli import config_from_args

    monkeypatch.setenv("KUBEINFER_API_KEY", "engine-side")
    monkeypatch.setenv("KUBEINFER_ENGINE_API_KEY", "gateway-side")
    serve = build_parser(["serve", "m"]).parse_args(["serve", "m"])
    gateway = build_parser(["gateway"]).parse_args(["gateway", "--endpoints", "http://e:8000"])
    assert serve.api_key == "engine-side" and gateway.engine_api_key == "gateway-side"
    config = config_from_args(gateway)
    assert config.engine_api_key == "gateway-side" and not config.trust_priority_headers
    assert (config.guard.max_body_bytes, config.guard.max_concurrent_requests) == (16 << 20, 8192)
    assert (serve.max_request_body_bytes, serve.header_read_timeout, serve.body_read_timeout) == (16 << 20, 10.0, 60.0)


# -- issue #44 finding 6: a Responses body is charged by what the engine honours there -------------------------
def test_a_responses_body_is_charged_its_max_output_tokens_not_a_decoy_max_tokens():
    """The engine ignores max_tokens (and n) on /v1/responses: a max_tokens of 1 beside max_output_tokens made
    the charge 2 tokens for a 100,000-token request."""
    from kubeinfer.gateway.handlers.request_info import parse_request

    decoy = {"model": "m", "input": "hi", "max_tokens": 1, "n": 1, "max_output_tokens": 100_000}
    request = parse_request(json.dumps(decoy).encode(), {})
    assert request.estimated_tokens == 1 + 100_000 and request.max_tokens == 100_000
    assert estimate_request_tokens({**decoy, "n": 50}) == 1 + 100_000  # no n on /v1/responses
    assert estimate_request_tokens({"model": "m", "input": "hi", "max_tokens": 1}) == 1 + 256  # the default
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert estimate_request_tokens(chat) == 1 + 1  # chat does honour max_tokens


def test_every_responses_input_item_is_counted():
    """400k characters of function_call arguments were estimated as 257 tokens."""
    arguments = json.dumps({"text": "a" * 400_000})
    body = {"model": "m", "max_output_tokens": 10, "input": [
        {"role": "user", "content": "x" * 40},
        {"type": "function_call", "call_id": "c1", "name": "n" * 40, "arguments": arguments},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "o" * 40}]},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "r" * 40}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "t" * 4000}]},  # not fed back
    ]}
    chars = 40 + 40 + len(arguments) + 40 + 40
    assert estimate_request_tokens(body) == chars // 4 + 1 + 10
    chat = {"model": "m", "max_tokens": 10, "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                              "function": {"name": "f", "arguments": arguments}}]}]}
    assert estimate_request_tokens(chat) == (1 + len(arguments)) // 4 + 1 + 10
