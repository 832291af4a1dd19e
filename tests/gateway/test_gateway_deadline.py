"""Time budgets (`x-request-timeout-ms`): the gateway refuses at once when the fair queue's expected wait
exceeds the budget, answers 503 when the budget runs out while waiting, and forwards what is left to
the engine, in proxy and ext_proc modes."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from test_gateway_fair_queue import saturated_pool
from test_gateway_tenants import Engine, _processor, _request, _run, post, start_gateway

from kubeinfer.gateway.flowcontrol.deadline import deadline_of, remaining_ms_header
from kubeinfer.gateway.datastore.endpoints import EngineState
from kubeinfer.gateway.flowcontrol.fair_queue import FairQueue
from kubeinfer.gateway.scheduling.picker import RoutingError, RoutingRequest


def test_the_budget_header_is_parsed_and_checked():
    assert deadline_of({}) is None
    assert deadline_of({"x-request-timeout-ms": "1500"}, now=10.0) == 11.5
    for bad in ("0", "-5", "soon"):
        with pytest.raises(RoutingError) as refused:
            deadline_of({"x-request-timeout-ms": bad})
        assert refused.value.status == 400 and "x-request-timeout-ms must be a positive integer" in refused.value.message
    assert remaining_ms_header(time.monotonic() - 5) == "1"  # spent: the engine ends it at once


async def test_a_budget_shorter_than_the_expected_queue_wait_is_refused_at_once():
    picker, _ = saturated_pool()
    queue = FairQueue(picker)
    now = time.monotonic()
    queue._dispatched["base"].extend([now - 2, now - 1, now])  # one dispatch a second lately
    waiting = [asyncio.create_task(queue.wait(RoutingRequest(model="base"), "a")) for _ in range(3)]
    await asyncio.sleep(0.02)
    started = time.monotonic()
    with pytest.raises(RoutingError) as refused:
        await queue.wait(RoutingRequest(model="base", deadline=time.monotonic() + 0.5), "b")
    assert time.monotonic() - started < 0.05  # at once, not after waiting
    assert (refused.value.status, refused.value.retry_after) == (429, 4)
    assert refused.value.message.startswith("waiting for a free pod of `base` would take about 4.0 s, more than the")
    assert refused.value.message.endswith("ms left of the request's x-request-timeout-ms")
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_budget_that_runs_out_in_the_queue_is_a_503_with_retry_after():
    picker, _ = saturated_pool()
    started = time.monotonic()
    with pytest.raises(RoutingError) as refused:
        await FairQueue(picker).wait(RoutingRequest(model="base", deadline=time.monotonic() + 0.2), "a")
    assert 0.15 < time.monotonic() - started < 1.0
    assert (refused.value.status, refused.value.retry_after) == (503, 1)
    assert refused.value.message == "the request's x-request-timeout-ms ran out while it waited for a free pod of `base`"


async def test_proxy_forwards_what_is_left_of_the_budget():
    async with Engine() as engine:
        gateway = await start_gateway([engine])
        try:
            assert (await post(gateway, headers={"x-request-timeout-ms": "5000"})).status_code == 200
            assert (await post(gateway)).status_code == 200
            bad = await post(gateway, headers={"x-request-timeout-ms": "later"})
        finally:
            await gateway.stop()
    assert 4000 < int(engine.headers[0]["x-request-timeout-ms"]) <= 5000
    assert "x-request-timeout-ms" not in engine.headers[1]
    assert bad.status_code == 400 and len(engine.headers) == 2


async def test_proxy_answers_503_when_the_budget_runs_out_in_the_fair_queue(tmp_path):
    from test_gateway_tenants import write_tenants

    async with Engine(waiting=10) as engine:
        gateway = await start_gateway([engine], tenants_file=write_tenants(tmp_path))
        try:
            response = await post(gateway, "key-a", headers={"x-request-timeout-ms": "300"})
        finally:
            await gateway.stop()
    assert response.status_code == 503 and response.headers["retry-after"] == "1" and engine.bodies == []
    assert "x-request-timeout-ms ran out while it waited" in response.json()["error"]["message"]


async def test_ext_proc_sets_the_remaining_budget_header(tmp_path):
    processor, _ = _processor(tmp_path)
    messages = _request("key-a")
    messages[0].request_headers.headers.headers.add(key="x-request-timeout-ms", raw_value=b"2000")
    replies = await _run(processor, messages)
    headers = {h.header.key: h.header.raw_value.decode()
               for h in replies[-1].request_body.response.header_mutation.set_headers}
    assert headers["x-gateway-destination-endpoint"] == "10.0.0.1:8000"
    assert 1000 < int(headers["x-request-timeout-ms"]) <= 2000


async def test_ext_proc_budget_runs_out_in_the_fair_queue(tmp_path):
    processor, router = _processor(tmp_path)
    router.fair_queue = FairQueue(router.picker)
    next(iter(router.picker.pool)).state = EngineState(waiting=10)
    messages = _request("key-a")
    messages[0].request_headers.headers.headers.add(key="x-request-timeout-ms", raw_value=b"100")
    answer = (await asyncio.wait_for(_run(processor, messages), 2))[-1].immediate_response
    assert answer.status.code == 503
    assert {h.header.key: h.header.raw_value for h in answer.headers.set_headers}["retry-after"] == b"1"


# -- the engine honours the budget it is forwarded (kubeinfer/engine/entrypoints/openai/streaming.py) ------------
class SlowEngine:
    """Streams one more token every 50 ms, for ever; records the requests it aborted."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def stream(self, request, slot):
        from kubeinfer.engine.core.outputs import CompletionOutput, RequestOutput

        tokens = []
        try:
            while True:
                await asyncio.sleep(0.05)
                tokens.append(len(tokens))
                yield RequestOutput(request.request_id, None, [1, 2, 3], [
                    CompletionOutput(0, "x" * len(tokens), list(tokens))], False, num_cached_tokens=2)
        finally:
            self.aborted.append(request.request_id)


def _engine_request(request_id: str):
    from types import SimpleNamespace

    return SimpleNamespace(request_id=request_id, prompt=None, prompt_token_ids=[1, 2, 3],
                           params=SimpleNamespace(n=1))


async def test_the_engine_ends_a_request_when_its_budget_is_spent_and_still_reports_usage():
    from kubeinfer.engine.entrypoints.openai.serving_completion import CompletionFormat
    from kubeinfer.engine.entrypoints.openai.streaming import stream_chunks, stream_sse
    from kubeinfer.engine.entrypoints.request_budget import budget_deadline

    engine = SlowEngine()
    loop = asyncio.get_running_loop()
    deadline = budget_deadline({"x-request-timeout-ms": "300"}, loop.time())
    chunks = stream_chunks(engine, [(_engine_request("r-0"), None)], CompletionFormat("m", None), "r", 1, True, deadline)
    events = [e async for e in stream_sse(chunks)]
    assert loop.time() - deadline < 0.2
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    await asyncio.sleep(0.05)  # the cancelled pump leaves engine.stream, which aborts the request
    assert events[-1] == "data: [DONE]\n\n" and engine.aborted == ["r-0"]
    assert payloads[-2]["choices"][0]["finish_reason"] == "timeout"
    usage = payloads[-1]["usage"]
    assert usage["prompt_tokens"] == 3 and usage["prompt_tokens_details"] == {"cached_tokens": 2}
    assert usage["completion_tokens"] == len("".join(p["choices"][0]["text"] for p in payloads[:-1])) > 0


async def test_the_engine_ignores_an_absent_or_invalid_budget():
    from kubeinfer.engine.entrypoints.request_budget import budget_deadline

    assert budget_deadline({}, 5.0) is None and budget_deadline({"x-request-timeout-ms": "x"}, 5.0) is None
    assert budget_deadline({"x-request-timeout-ms": "250"}, 5.0) == 5.25
