"""Every OpenAI / vLLM request field is honoured or refused with a 400 naming it, never accepted and
ignored; unknown fields are ignored with a warning that names them. Driven through the real HTTP app."""
import json
import logging

import httpx
import openai
import pytest

from kubeinfer.engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions

PROMPT = "The licensee may copy and distribute"
MESSAGES = [{"role": "user", "content": "Hello"}]
IGNORED = "present in the request but ignored"


def token_ids(client, max_tokens=6, **kwargs) -> list[int]:
    extra = {"return_token_ids": True, "ignore_eos": True, **kwargs.pop("extra_body", {})}
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, extra_body=extra,
                                         **{"temperature": 0, **kwargs})
    return response.choices[0].model_extra["token_ids"]


def test_logit_bias_plus_100_makes_every_token_that_id(client, server):
    assert token_ids(client, logit_bias={"300": 100}) == [300] * 6
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                          logit_bias={"300": 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == server.engine.tokenizer.decode([300] * 5)


def test_logit_bias_minus_100_on_the_greedy_token_changes_the_output(client):
    greedy = token_ids(client)
    banned = token_ids(client, logit_bias={str(greedy[0]): -100})
    assert banned[0] != greedy[0] and greedy[0] not in banned
    sampled = token_ids(client, temperature=1.0, seed=5, max_tokens=12, logit_bias={str(greedy[0]): -100})
    assert greedy[0] not in sampled


def test_allowed_token_ids_restrict_the_output(client, server):
    allowed = [17, 99, 250]
    assert set(token_ids(client, max_tokens=16, temperature=1.0, seed=1,
                         extra_body={"allowed_token_ids": allowed})) <= set(allowed)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                          extra_body={"allowed_token_ids": [250], "ignore_eos": True})
    assert chat.choices[0].message.content == server.engine.tokenizer.decode([250] * 4)


def test_best_of_equal_to_n_is_accepted(client):
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=2, best_of=2, seed=3)
    assert len(response.choices) == 2


def test_trivial_values_of_unsupported_fields_are_accepted_without_warning(client, caplog):
    with caplog.at_level(logging.WARNING):
        chat = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=2, response_format={"type": "text"}, tools=[],
            tool_choice="none", parallel_tool_calls=False, user="u1", metadata={"team": "a"}, store=False,
            service_tier="auto", extra_body={"best_of": 1, "bad_words": [], "use_beam_search": False})
    assert chat.choices[0].message.role == "assistant"
    assert IGNORED not in caplog.text


def test_unknown_fields_are_ignored_with_a_warning_naming_them(server, caplog):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi", "mood": "ann"}], "max_tokens": 2,
            "stream": True, "stream_options": {"include_usage": True, "flavour": 1}, "not_a_field": 1}
    with caplog.at_level(logging.WARNING):
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    warning = next(r.getMessage() for r in caplog.records if IGNORED in r.getMessage())
    assert all(name in warning for name in ("not_a_field", "messages[0].mood", "stream_options.flavour"))


REFUSED_CHAT = [
    ("tool_choice", "required"),  # without tools there is nothing to call
    ("functions", [{"name": "f"}]), ("function_call", "auto"),
    ("best_of", 2), ("bad_words", ["licensee"]),
    ("use_beam_search", True), ("prompt_logprobs", 1), ("modalities", ["text", "audio"]),
    ("reasoning_effort", "high"), ("continue_final_message", True), ("add_special_tokens", True),
]
REFUSED_COMPLETION = [("echo", True), ("suffix", "end"), ("best_of", 3), ("bad_words", ["x"]), ("add_special_tokens", False),
                      ("logits_processors", ["x"]), ("truncate_prompt_tokens", 4)]
INVALID = [("logit_bias", {"5": 101}), ("logit_bias", {"-1": 1}), ("allowed_token_ids", []),
           ("allowed_token_ids", [-3]), ("seed", 2**64), ("seed", -2**63 - 1)]


@pytest.mark.parametrize("field,value", REFUSED_CHAT + INVALID)
def test_chat_fields_refused_with_a_400_naming_them(client, field, value):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body={field: value})
    assert error.value.param == field and error.value.body["message"].startswith(field), error.value.body


@pytest.mark.parametrize("field,value", REFUSED_COMPLETION + INVALID)
def test_completion_fields_refused_with_a_400_naming_them(server, field, value):
    response = httpx.post(server.url + "/v1/completions",
                          json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(field), error


def test_tools_without_tool_choice_mean_auto(server):
    """OpenAI's default with tools is "auto" (LangChain and the Agents SDK send no tool_choice): served
    with the format the model's chat template writes, not refused for a missing server flag."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3,
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    response = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


def stream_chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def emitted_tokens(chunk: dict) -> int:
    """The tokens a chunk carries, counted by their log-prob entries (chat: logprobs.content; completions:
    logprobs.tokens): a chunk may carry several tokens when the stream's reader falls behind the engine."""
    total = 0
    for choice in chunk["choices"]:
        logprobs = choice.get("logprobs") or {}
        total += len(logprobs.get("content") or logprobs.get("tokens") or [])
    return total


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True}),
    ("/v1/completions", {"prompt": [PROMPT, "Hello"], "n": 2, "logprobs": 1}),
])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server, path, body):
    """guidellm sends {"include_usage": true, "continuous_usage_stats": true} on every streamed request. Each
    chunk's completion_tokens counts at least the tokens streamed so far (all of them with one choice; with
    several, the others' generated tokens may still be on their way), and never goes back."""
    body = {"model": "tiny", "max_tokens": 7, "ignore_eos": True, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **body}
    chunks = stream_chunks(server, path, body)
    final = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and final["completion_tokens"] == 7 * len(body.get("prompt", [1])) * body.get("n", 1)
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-2] == final["completion_tokens"]
    streamed = 0
    for chunk in chunks[:-1]:
        streamed += emitted_tokens(chunk)
        so_far = chunk["usage"]["completion_tokens"]
        assert so_far == streamed if "messages" in body else so_far >= streamed
    assert streamed == final["completion_tokens"]
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == final["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    without = stream_chunks(server, path, {**body, "stream_options": {"include_usage": True}})
    counted = ("prompt_tokens", "completion_tokens", "total_tokens")  # the repeat may hit the prefix cache
    assert all("usage" not in chunk for chunk in without[:-1])
    assert {k: without[-1]["usage"][k] for k in counted} == {k: final[k] for k in counted}


@pytest.mark.parametrize("kwargs", [{"chat_template": "{{ 'mine' }}"}, {"tokenize": True}, {"tools": []},
                                    {"x": "y" * 5000}, {"x": ["a"]}, {"x": {"a": 1}}])
def test_chat_template_kwargs_take_plain_values_only(server, kwargs):
    """A client's own template (vLLM's CVE-2025-61620) or apply_chat_template's own parameters never
    reach the renderer: a 400 naming chat_template_kwargs before any work."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": kwargs}
    response = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs", response.text
    plain = {**body, "chat_template_kwargs": {"enable_thinking": False, "custom": "short", "n": 3}}
    assert httpx.post(server.url + "/v1/chat/completions", json=plain).status_code == 200


def test_seed_at_the_64_bit_bounds_is_accepted(client):
    for seed in (2**64 - 1, -2**63):
        assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, seed=seed).choices


@pytest.mark.parametrize("field,value", [("logit_bias", {"100000": 5}), ("allowed_token_ids", [1, 100000])])
def test_token_ids_outside_the_vocabulary_are_400(server, field, value):
    response = httpx.post(server.url + "/v1/completions",
                          json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest, StreamOptions])
def test_every_refused_field_is_declared(model):
    """A refusal rule for a field the model does not declare would never run: the field would only warn."""
    assert set(model.refused) <= set(model.model_fields)
