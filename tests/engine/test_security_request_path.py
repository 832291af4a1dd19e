"""Issue #44, the residual request-path findings on the engine: a large /v1/responses body is translated and
validated off the event loop (finding 5), and unknown field names reach the log cut short, escaped and
counted, never echoed whole (finding 8), nor into a 400's message. Loopback, a real server, a few MB."""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import pytest

from kubeinfer.engine.entrypoints.openai.protocol import ChatCompletionRequest
from kubeinfer.engine.entrypoints.openai.protocol_base import MAX_LOGGED_FIELDS, MAX_LOGGED_NAME_CHARS

IGNORED = "present in the request but ignored"


# -- finding 5: /v1/responses validated off the loop ---------------------------------------------------------
def test_a_large_responses_body_does_not_stall_health(server, monkeypatch):
    """The chat body a response runs as is validated where the loop is not: while it validates (held here until
    /health has answered), /health answers. Before, it ran on the loop and /health waited for it."""
    validating, health_answered = threading.Event(), threading.Event()
    on_loop: list[bool] = []
    real = ChatCompletionRequest.model_validate.__func__

    def model_validate(cls, obj, *args, **kwargs):
        on_loop.append(asyncio._get_running_loop() is not None)
        validating.set()
        health_answered.wait(20)
        return real(cls, obj, *args, **kwargs)
    monkeypatch.setattr(ChatCompletionRequest, "model_validate", classmethod(model_validate))
    items = [{"role": "user", "content": "hi"}] * 90_000  # 3 MB of input items
    body = {"model": "tiny", "input": items, "max_output_tokens": 1}
    replies: list[httpx.Response] = []
    big = threading.Thread(target=lambda: replies.append(httpx.post(server.url + "/v1/responses", json=body,
                                                                       timeout=60)))
    big.start()
    try:
        assert validating.wait(30)
        started = time.perf_counter()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        waited = time.perf_counter() - started
    finally:
        health_answered.set()
        big.join(60)
    assert on_loop == [False] and waited < 5
    assert replies[0].status_code == 400  # longer than this tiny model takes


def test_a_small_responses_body_is_still_served(client):
    response = client.responses.create(model="tiny", input="Hello", max_output_tokens=2)
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens >= 1


# -- finding 8: unknown field names logged short, escaped and counted; 400s bounded --------------------------
def test_unknown_field_names_are_logged_cut_short_and_counted(server, caplog):
    before = server.metric("kubeinfer:request_fields_ignored_total")
    names = [f"\x1b[31m{i}" + "n" * 20_000 for i in range(40)]  # 800 kB of field names
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            **{name: 1 for name in names}}
    with caplog.at_level(logging.WARNING):
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text[:300]
    warning = next(r.getMessage() for r in caplog.records if IGNORED in r.getMessage())
    assert len(warning) < MAX_LOGGED_FIELDS * (MAX_LOGGED_NAME_CHARS + 20) + 200, len(warning)
    assert "\x1b" not in warning and "\\x1b[31m" in warning  # escaped: no terminal escape reaches the log
    assert f"and {40 - MAX_LOGGED_FIELDS} more" in warning
    assert server.metric("kubeinfer:request_fields_ignored_total") == before + 40


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"k" * 100_000: 1}}),
    ("/v1/responses", {"input": [{"type": "k" * 100_000}]}),
    ("/v1/responses", {"input": "x", "metadata": {"k" * 100_000: 1}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "k " * 50_000}),
])
def test_a_400_never_echoes_a_body_back_whole(server, path, body):
    response = httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and len(response.content) < 2_000, error["message"][:200]
    assert len(error["param"] or "") <= 131 and error["message"].split(":", 1)[0]  # still says which field
