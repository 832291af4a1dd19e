"""Reasoning models (`--reasoning-parser`, vLLM's names): the thinking goes to message.reasoning
(delta.reasoning when streamed), the answer to content, tool calls are found in the answer, and
chat_template_kwargs (`enable_thinking`) reach the model's template. Through the official client."""
from __future__ import annotations

import json
import re
import shutil

import httpx
import openai
import pytest
from server_harness import RunningServer

from kubeinfer.engine.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningStream

# Qwen3's switch, as its template reads it: thinking off writes an empty think block into the prompt.
QWEN3_LIKE = ("{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n"
              "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
              "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
              "<|im_start|>assistant\n"
              "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def reasoning_server(llama_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    model = tmp_path_factory.mktemp("reasoning") / "model"
    shutil.copytree(llama_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = QWEN3_LIKE
    tokenizer.save_pretrained(model)
    with RunningServer(str(model), name="tiny", block_size=8, reasoning_parser="qwen3",
                       tool_call_parser="hermes") as running:
        yield running


@pytest.fixture(scope="module")
def client(reasoning_server):
    return openai.OpenAI(base_url=reasoning_server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def steered(client, written: str, stream: bool, **kwargs):
    """A reply the model is made to write (a regex constraint), whole or streamed."""
    return client.chat.completions.create(model="tiny", messages=ASK, max_tokens=kwargs.pop("max_tokens", 200),
                                          stream=stream, extra_body={"guided_regex": re.escape(written)}, **kwargs)


def streamed(stream) -> dict:
    out = {"reasoning": "", "content": "", "calls": [], "finish": None}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta.model_extra or {}
            out["reasoning"] += delta.get("reasoning") or ""
            out["content"] += choice.delta.content or ""
            out["calls"] += [(c.function.name, c.function.arguments) for c in choice.delta.tool_calls or [] if c.id]
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def test_thinking_goes_to_reasoning_and_the_answer_to_content(client):
    written = "<think>Two plus three.\nIt is five.</think>\n\nThe answer is 5."
    whole = steered(client, written, stream=False).choices[0]
    assert whole.message.model_extra["reasoning"] == "Two plus three.\nIt is five."
    assert whole.message.model_extra["reasoning_content"] == "Two plus three.\nIt is five."  # vLLM's older name
    assert whole.message.content == "The answer is 5." and whole.finish_reason == "stop"
    parts = streamed(steered(client, written, stream=True))
    assert parts["reasoning"] == "Two plus three.\nIt is five." and parts["content"] == "The answer is 5."


def test_a_reply_cut_while_thinking_is_all_reasoning(client):
    written = "<think>Two plus three is a sum of small numbers, so</think>done"
    whole = steered(client, written, stream=False, max_tokens=20).choices[0]
    assert whole.finish_reason == "length" and not whole.message.content
    assert written[len("<think>"):].startswith(whole.message.model_extra["reasoning"])
    parts = streamed(steered(client, written, stream=True, max_tokens=20))
    assert parts["reasoning"] == whole.message.model_extra["reasoning"] and parts["content"] == ""


def test_tool_calls_are_found_after_the_thinking(client):
    written = '<think>I should call add.</think>\n\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    whole = steered(client, written, stream=False, tools=TOOLS).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.model_extra["reasoning"] == "I should call add."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == \
        [("add", {"a": 2, "b": 3})]
    parts = streamed(steered(client, written, stream=True, tools=TOOLS))
    assert parts["reasoning"] == "I should call add." and parts["finish"] == "tool_calls"
    assert [(name, json.loads(arguments or "{}")) for name, arguments in parts["calls"]][0][0] == "add"


def test_enable_thinking_reaches_the_template(client):
    """chat_template_kwargs go to the model's own template: thinking off adds its empty think block."""
    on = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
    off = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens


def test_reasoning_effort_reaches_a_template_that_reads_it(client, reasoning_server):
    server = reasoning_server
    """OpenAI's reasoning_effort (and the Responses API's reasoning.effort) go to a template that reads
    them, as gpt-oss's does; a template that does not is a 400 (test_request_fields)."""
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
    high = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1, reasoning_effort="high")
    assert high.usage.prompt_tokens > plain.usage.prompt_tokens
    response = client.responses.create(model="tiny", input=ASK[0]["content"], max_output_tokens=1,
                                       reasoning={"effort": "high"})
    assert response.usage.input_tokens == high.usage.prompt_tokens and response.reasoning.effort == "high"
    refused = httpx.post(server.url + "/v1/responses", json={"model": "tiny", "input": "Hi",
                                                             "reasoning": {"summary": "detailed"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning"


@pytest.mark.parametrize("name,text,expected", [
    ("qwen3", "<think>a</thi</think>\n\nb<think>c", ("a</thi", "b<think>c")),
    ("qwen3", "plain answer, thinking off", ("", "plain answer, thinking off")),
    ("qwen3", "<think>still thinking", ("still thinking", "")),
    ("deepseek_r1", "thought with the tag in the prompt</think>answer", ("thought with the tag in the prompt", "answer")),
    ("deepseek_r1", "<think>own tag</think>answer", ("own tag", "answer")),
    ("deepseek_r1", "never closed", ("never closed", "")),
])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_streamed_splits_add_up_to_the_whole_one(name, text, expected, step):
    """Whatever the pieces a reply comes in, the reasoning and content sent add up to the final split."""
    parser = REASONING_PARSERS[name]
    assert parser.split(text, finished=True) == expected
    stream, reasoning, content = ReasoningStream(parser), "", ""
    for end in [*range(step, len(text), step), len(text)]:
        new, content_so_far = stream.update(text[:end], finished=end == len(text))
        assert content_so_far.startswith(content)
        reasoning, content = reasoning + new, content_so_far
    assert (reasoning, content) == expected


def test_responses_carry_the_thinking_as_a_reasoning_item(client):
    written = "<think>Two plus three.</think>\n\nFive."
    ask = {"model": "tiny", "input": "What is 2 + 3?", "max_output_tokens": 100,
           "extra_body": {"guided_regex": re.escape(written)}}
    whole = client.responses.create(**ask)
    assert [item.type for item in whole.output] == ["reasoning", "message"] and whole.output_text == "Five."
    assert whole.output[0].content[0].text == "Two plus three."
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    with client.responses.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and final.output_text == "Five."
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Two plus three."
