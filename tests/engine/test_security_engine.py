"""Issue #34, the engine's half of the request path: each finding reproduced on loopback against a real
server, with a few MB standing in for hundreds and memory and waiting asserted as bounds."""
from __future__ import annotations

import json
import threading

import grpc
import httpx
import pytest
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
from test_grpc import GrpcThread

from kubeinfer.engine.entrypoints.grpc.proto import engine_pb2, engine_pb2_grpc
from kubeinfer.engine.entrypoints.request_limits import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    PROMPT_CHARS_PER_TOKEN,
)
from kubeinfer.common.http_guard import GuardConfig

LIMIT = 1 << 20  # the body limit these servers run with: a few MB stand in for hundreds
GUARD = GuardConfig(max_body_bytes=LIMIT, body_read_timeout=1.0, max_concurrent_requests=64)


@pytest.fixture(scope="module")
def server(llama_dir):
    with RunningServer(llama_dir, name="tiny", block_size=8, guard=GUARD, header_read_timeout=0.5) as running, \
            GrpcThread(running.state) as grpc_server:
        running.grpc = grpc_server
        yield running


def complete(server, timeout: float = 30.0, headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", **body},
                      headers=headers, timeout=timeout)


# -- finding 1 / 12: the key guards the whole API, not only /v1 -------------------------------------------
def test_the_api_key_guards_load_and_the_schema_but_not_probes(llama_dir):
    with RunningServer(llama_dir, name="tiny", api_key="s3cret") as keyed:
        for path in ("/load", "/openapi.json", "/docs", "/v1/models"):
            assert httpx.get(keyed.url + path).status_code == 401, path
            assert httpx.get(keyed.url + path, headers={"Authorization": "Bearer s3cret"}).status_code == 200, path
        for path in ("/health", "/metrics", "/version"):  # kubelet probes and Prometheus carry no key
            assert httpx.get(keyed.url + path).status_code == 200, path


# -- finding 2: prompts bounded before tokenizing; tokenizing never stalls the pod ----------------------
def test_an_overlong_prompt_is_refused_before_it_is_tokenized(server, monkeypatch):
    tokenized: list[int] = []
    engine = server.engine
    real = engine.tokenize
    monkeypatch.setattr(engine, "tokenize", lambda text: tokenized.append(len(text)) or real(text))
    limit = PROMPT_CHARS_PER_TOKEN * engine.max_model_len
    response = complete(server, prompt="a" * (limit + 1))
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert str(limit) in response.json()["error"]["message"]
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "b" * (limit // 2 + 1)}] * 2})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert not tokenized  # neither was tokenized, nor rendered
    assert complete(server, prompt="a" * 50, max_tokens=1).status_code == 200


def test_a_slow_tokenization_does_not_hold_other_requests(server, monkeypatch):
    engine, release = server.engine, threading.Event()
    real = engine.tokenize

    def tokenize(text: str):
        if text.startswith("SLOW"):
            release.wait(30)  # a huge prompt's tokenization, held until the short request is served
        return real(text)
    monkeypatch.setattr(engine, "tokenize", tokenize)
    slow = threading.Thread(target=lambda: complete(server, prompt="SLOW prompt", max_tokens=1))
    slow.start()
    try:
        assert complete(server, prompt="quick", max_tokens=1, timeout=10).status_code == 200
    finally:
        release.set()
        slow.join(30)


def test_a_large_json_body_is_parsed_off_the_event_loop(server, monkeypatch):
    parsing, health_answered = threading.Event(), threading.Event()
    real = json.loads

    def loads(text, *args, **kwargs):
        if len(text) > 100_000:  # the large body: its parse lasts until /health has answered
            parsing.set()
            health_answered.wait(20)
        return real(text, *args, **kwargs)
    monkeypatch.setattr(json, "loads", loads)
    big = threading.Thread(target=lambda: complete(server, prompt="word " * 40_000, max_tokens=1))
    big.start()
    try:
        assert parsing.wait(10)
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    finally:
        health_answered.set()
        big.join(30)


def test_a_large_body_is_validated_off_the_event_loop(server, monkeypatch):
    """Validating millions of token ids takes seconds of CPU: it must not run where the loop runs."""
    import asyncio

    from kubeinfer.engine.entrypoints.openai.protocol import CompletionRequest
    validated_on_loop: list[bool] = []
    real = CompletionRequest.model_validate.__func__

    def model_validate(cls, obj, *args, **kwargs):
        validated_on_loop.append(asyncio._get_running_loop() is not None)
        return real(cls, obj, *args, **kwargs)
    monkeypatch.setattr(CompletionRequest, "model_validate", classmethod(model_validate))
    response = complete(server, prompt=[1] * 100_000, max_tokens=1)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"  # longer than the context
    assert validated_on_loop == [False]
    invalid = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny", "prompt": [' + b"1," * 50_000,
                         headers={"content-type": "application/json"})
    assert invalid.status_code == 400 and "not valid JSON" in invalid.json()["error"]["message"]
    wrong = complete(server, prompt=[1] * 50_000 + ["x"], max_tokens=1)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"].startswith("prompt")


# -- finding 4: body size limits, by Content-Length and by count, with memory bounded -------------------
def test_a_body_announced_over_the_limit_is_refused_before_it_is_sent(server):
    answer = announce_huge_body(server.port, 300 << 20)
    assert status_of(answer) == 413
    error = json_of(answer)["error"]
    assert error["code"] == 413 and str(LIMIT) in error["message"]


def test_a_chunked_body_over_the_limit_is_refused_with_memory_bounded(server):
    with traced_peak() as memory:
        answer = send_chunked_until_refused(server.port, 8 * LIMIT)
    assert status_of(answer) == 413 and json_of(answer)["error"]["code"] == 413
    assert memory["peak"] < 3 * LIMIT  # the server never held the 8 MB it was sent
    assert httpx.get(server.url + "/health").status_code == 200


# -- finding 7: per-token lists bounded ----------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("stop", [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]),
    ("stop", ["x" * (MAX_STOP_STRING_CHARS + 1)]),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
    ("allowed_token_ids", [1] * 100_000),
    ("logit_bias", {str(i): 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}),
])
def test_oversized_token_lists_are_refused_naming_the_field(server, field, value):
    response = complete(server, max_tokens=1, **{field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field and "at most" in response.json()["error"]["message"]


def test_lists_within_bounds_still_work_and_masks_are_built_once(server, monkeypatch):
    from kubeinfer.engine.model_executor import sampler
    builds: list[str] = []
    real = sampler._per_request_tensors

    def counted(params, name, build, vocab, device):
        return real(params, name, lambda: builds.append(name) or build(), vocab, device)
    monkeypatch.setattr(sampler, "_per_request_tensors", counted)
    response = complete(server, max_tokens=8, ignore_eos=True, temperature=0, stop=["zzz"] * 4,
                        allowed_token_ids=list(range(100)), logit_bias={"5": 2.0})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
    assert sorted(builds) == ["allowed_token_ids", "logit_bias"]  # once each, not at each of the 8 tokens


# -- finding 8: the time budget checked before admission; errors after admission abort -----------------
@pytest.mark.parametrize("value", ["1" * 400, "abc", "0", "-5", "1e3"])
def test_a_bad_timeout_header_is_a_400_before_admission(server, value):
    before = server.async_engine.num_unfinished
    response = complete(server, max_tokens=1, headers={"x-request-timeout-ms": value})
    assert response.status_code == 400 and response.json()["error"]["param"] == "x-request-timeout-ms"
    assert server.async_engine.num_unfinished == before


def test_a_bad_timeout_header_is_invalid_argument_over_grpc(server):
    stub = engine_pb2_grpc.EngineStub(server.grpc.channel)
    request = engine_pb2.GenerateRequest(model="tiny", text="Hello", sampling=engine_pb2.SamplingParams(max_tokens=1))
    with pytest.raises(grpc.RpcError) as failure:
        list(stub.Generate(request, metadata=[("x-request-timeout-ms", "9" * 400)]))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x-request-timeout-ms" in failure.value.details()


def test_an_error_after_admission_aborts_what_was_admitted(server, monkeypatch):
    from kubeinfer.engine.entrypoints.openai import serving_engine

    def broken(*_):
        raise RuntimeError("injected after admission")
    monkeypatch.setattr(serving_engine, "budget_deadline", broken)
    generated = server.metric("vllm:generation_tokens_total")
    response = complete(server, max_tokens=400, ignore_eos=True)
    assert response.status_code == 500
    assert server.wait_for(lambda: server.async_engine.num_unfinished == 0, 30)
    assert server.metric("vllm:generation_tokens_total") - generated < 400  # it did not run to its end unread


def test_an_error_after_admission_aborts_over_grpc(server, monkeypatch):
    from kubeinfer.engine.entrypoints.grpc import server as grpc_server

    def broken(*_):
        raise RuntimeError("injected after admission")
    monkeypatch.setattr(grpc_server, "call_deadline", broken)
    generated = server.metric("vllm:generation_tokens_total")
    stub = engine_pb2_grpc.EngineStub(server.grpc.channel)
    request = engine_pb2.GenerateRequest(model="tiny", text="Hello", sampling=engine_pb2.SamplingParams(
        max_tokens=400, ignore_eos=True))
    with pytest.raises(grpc.RpcError):
        list(stub.Generate(request))
    assert server.wait_for(lambda: server.async_engine.num_unfinished == 0, 30)
    assert server.metric("vllm:generation_tokens_total") - generated < 400


# -- finding 9: slowloris --------------------------------------------------------------------------------
def test_half_sent_heads_are_closed(server):
    sockets = [half_sent_head(server.port) for _ in range(50)]
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        still_open = [s for s in sockets if closed_or_answered(s, 10.0) is None]
        assert not still_open, f"{len(still_open)} of 50 half-sent heads still held"
    finally:
        for s in sockets:
            s.close()


def test_half_sent_bodies_get_408(server):
    sockets = [half_sent_body(server.port) for _ in range(20)]
    try:
        answers = [closed_or_answered(s, 10.0) for s in sockets]
        assert all(a and status_of(a) == 408 for a in answers), answers[:3]
    finally:
        for s in sockets:
            s.close()


def test_requests_beyond_the_concurrency_limit_get_503_but_probes_pass(llama_dir):
    guard = GuardConfig(max_body_bytes=LIMIT, body_read_timeout=30.0, max_concurrent_requests=3)
    with RunningServer(llama_dir, name="tiny", guard=guard) as limited:
        holding = [half_sent_body(limited.port) for _ in range(3)]
        try:
            assert limited.wait_for(lambda: limited.server.config.app is not None and complete(
                limited, max_tokens=1).status_code == 503, 10)
            refused = complete(limited, max_tokens=1)
            assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == 503
            assert httpx.get(limited.url + "/health").status_code == 200
            assert httpx.get(limited.url + "/metrics").status_code == 200
        finally:
            for s in holding:
                s.close()
        assert limited.wait_for(lambda: complete(limited, max_tokens=1).status_code == 200, 10)


def test_the_stop_matcher_holds_back_exactly_what_the_plain_scan_does():
    """safe_length looks only where a stop could begin (stops indexed by first character at admission);
    it must hold back what comparing every tail with every stop holds back."""
    import random

    from kubeinfer.engine.core.detokenizer import StopStringMatcher
    from kubeinfer.engine.sampling_params import SamplingParams

    def reference(text: str, stops: list[str]) -> int:
        for hold in range(min(max(map(len, stops)) - 1, len(text)), 0, -1):
            if any(s.startswith(text[-hold:]) for s in stops):
                return len(text) - hold
        return len(text)

    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 12)))
        assert StopStringMatcher(SamplingParams(stop=stops)).safe_length(text) == reference(text, stops), (stops, text)
