"""`POST /v1/responses` (OpenAI's Responses API, stateless) through the official `openai` client: plain,
streamed (the client assembles the typed events itself), function tools and a tool round trip,
`text.format` json_schema and `responses.parse()` with a pydantic model, cuts by max_output_tokens,
and the fields a stateless server refuses. The reference for what is generated is the same
conversation through chat completions."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from server_harness import RunningServer

ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "add", "description": "Add two numbers", "parameters": ADD, "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]


@pytest.fixture(scope="module")
def server(long_context_dir):
    with RunningServer(long_context_dir, name="tiny", block_size=8) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def steer(written: str) -> dict:
    return {"guided_regex": re.escape(written)}


def test_a_response_says_what_the_same_chat_completion_says(client):
    ask = {"model": "tiny", "temperature": 0, "max_output_tokens": 12}
    response = client.responses.create(input="Hello there", instructions="Be brief.", **ask)
    chat = client.chat.completions.create(model="tiny", temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == 12
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.id.startswith("resp_") and response.output[0].type == "message"
    items = client.responses.create(input=[{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
                                    **ask)
    assert items.output_text == response.output_text


def test_a_streamed_response_assembles_into_the_whole_one(client):
    ask = {"model": "tiny", "input": "Hello there", "max_output_tokens": 50, "extra_body": steer("Hi, how are you?")}
    whole = client.responses.create(**ask)
    with client.responses.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert whole.status == final.status == "completed" and whole.output_text == final.output_text == "Hi, how are you?"
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") > 1 and "response.output_item.done" in kinds
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_function_tools_are_called_and_their_results_go_back_in(client):
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>'
    ask = {"model": "tiny", "input": "What is 2 + 40?", "tools": TOOLS, "max_output_tokens": 100,
           "extra_body": steer(call)}
    whole = client.responses.create(**ask)  # no tool_choice: "auto", the template's own format
    calls = [item for item in whole.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 40})]
    assert calls[0].call_id.startswith("call_") and whole.status == "completed"
    with client.responses.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == \
        [(c.name, c.arguments) for c in calls]
    history = [{"role": "user", "content": "What is 2 + 40?"}, calls[0].model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "42"}]
    answer = client.responses.create(model="tiny", input=history, tools=TOOLS, max_output_tokens=5, temperature=0)
    chat = client.chat.completions.create(model="tiny", tools=CHAT_TOOLS, max_tokens=5, temperature=0, messages=[
        history[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].call_id, "type": "function", "function": {"name": "add", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "42"}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens > whole.usage.input_tokens


def test_required_tool_choice_gives_arguments_that_validate(client):
    whole = client.responses.create(model="tiny", input="Add", tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add"
    jsonschema.validate(json.loads(calls[0].arguments), ADD)


class Sum(BaseModel):
    a: int
    b: int
    total: int


def test_text_format_json_schema_and_parse_with_a_pydantic_model(client):
    parsed = client.responses.parse(model="tiny", input="Add 2 and 3", text_format=Sum, max_output_tokens=300,
                                    temperature=0)
    assert isinstance(parsed.output_parsed, Sum)
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    raw = client.responses.create(model="tiny", input="Where?", max_output_tokens=100, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    assert json.loads(raw.output_text)["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("field,value,param", [
    ("previous_response_id", "resp_123", "previous_response_id"),
    ("store", True, "store"),
    ("background", True, "background"),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input"),
    ("input", [{"type": "item_reference", "id": "msg_1"}], "input"),
    ("tools", [{"type": "web_search"}], "tools"),
    ("text", {"format": {"type": "yaml"}}, "text.format"),
    ("temperature", 3, "temperature"),
    ("max_output_tokens", 0, "max_output_tokens"),
    ("tool_choice", {"type": "function", "name": "nope"}, "tool_choice"),
    ("model", "not-served", "model"),
])
def test_what_is_not_served_is_a_400_naming_the_field(server, field, value, param):
    body = {"model": "tiny", "input": "Hello", "max_output_tokens": 4, "tools": TOOLS, field: value}
    response = httpx.post(server.url + "/v1/responses", json=body)
    assert response.status_code == (404 if field == "model" else 400), response.text
    assert response.json()["error"]["param"] == param, response.text


def test_what_clients_send_is_accepted(server):
    """guidellm sends vLLM's ignore_eos and stop: null; the Agents SDK sends include: [] and store: false."""
    body = {"model": "tiny", "input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 6, "stop": None,
            "ignore_eos": True, "include": [], "store": False, "metadata": {"run": "1"}, "truncation": "disabled"}
    response = httpx.post(server.url + "/v1/responses", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["usage"]["output_tokens"] == 6 and data["metadata"] == {"run": "1"} and data["store"] is False


def test_an_engine_error_ends_the_stream_with_response_failed(llama_dir):
    from test_engine_faults import FailingSteps

    with RunningServer(llama_dir, name="tiny", block_size=8) as running:
        FailingSteps(running.engine.runner, {1}, RuntimeError("injected step failure"))
        with httpx.stream("POST", running.url + "/v1/responses", timeout=60,
                          json={"model": "tiny", "input": "Hi", "stream": True, "max_output_tokens": 4}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    kinds = [event["type"] for event in events]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"], kinds
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
