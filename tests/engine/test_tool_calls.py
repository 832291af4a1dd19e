"""Tool calling through the official `openai` client: a named function and `required` constrain decoding
to the functions' parameter schemas (validated with `jsonschema`), replies carry `tool_calls` with ids
and JSON-string arguments and finish_reason "tool_calls", streamed and not; `auto` parses the model's
own format with --tool-call-parser."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from server_harness import RunningServer

from kubeinfer.engine.entrypoints.openai.tool_calls import ToolPlan
from kubeinfer.engine.entrypoints.openai.tool_parsers import (
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    parser_for_template,
)
from kubeinfer.engine.entrypoints.openai.tool_stream import ToolStream

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(long_context_dir):
    with RunningServer(long_context_dir, name="tiny", block_size=8) as running:
        yield running


def check_calls(calls, count=None):
    assert calls and (count is None or len(calls) == count)
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_called_with_valid_arguments(client):
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, seed=1,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls, count=1)
    assert choice.message.tool_calls[0].function.name == "add"


@pytest.mark.parametrize("seed", range(3))
def test_required_calls_one_of_the_tools_when_parallel_calls_are_off(client, seed):
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=300, seed=seed)
    check_calls(reply.choices[0].message.tool_calls, count=1)
    assert reply.choices[0].finish_reason == "tool_calls"


def collect_stream(stream) -> tuple[dict, str | None, int]:
    """Streamed tool calls put together as a client does: {index: (id, name, arguments)}, the finish
    reason, and how many deltas carried argument text."""
    calls, finish, fragments = {}, None, 0
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.id:  # a call's first delta: id, type and name
                    assert delta.index not in calls and delta.type == "function" and delta.function.name
                    calls[delta.index] = [delta.id, delta.function.name, ""]
                fragments += bool(delta.function.arguments)
                calls[delta.index][2] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish, fragments


def test_streamed_tool_calls_arrive_as_deltas_that_add_up_to_the_reply(client):
    ask = {"model": "tiny", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 300, "seed": 4}
    calls, finish, fragments = collect_stream(client.chat.completions.create(**ask, stream=True))
    assert finish == "tool_calls" and calls
    assert fragments > 2 * len(calls)  # arguments come a piece at a time, not whole at the end
    for call_id, name, arguments in calls.values():
        assert call_id.startswith("call_")
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    whole = client.chat.completions.create(**ask).choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole] == \
        [(name, json.loads(arguments)) for _, name, arguments in calls.values()]


def test_constrained_requests_and_grammar_compiles_are_counted(server, client):
    before = server.metric("kubeinfer:structured_output_requests_total")
    for _ in range(2):
        client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=300, seed=9)
    assert server.metric("kubeinfer:structured_output_requests_total") == before + 2
    assert server.metric("kubeinfer:grammar_compiles_total") >= 1
    assert server.metric("kubeinfer:grammar_compile_seconds_total") > 0


def test_tools_reach_the_chat_template_and_earlier_calls_render(client):
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                                max_tokens=300, seed=5)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    call = with_tools.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    follow_up = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                               max_tokens=3)
    assert follow_up.choices[0].message.tool_calls is None and follow_up.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}], "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(server, extra, param):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, "tools": TOOLS, **extra}
    response = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def steer(written: str) -> dict:
    """A regex constraint that makes the model write `written` (braces escaped)."""
    return {"guided_regex": written.replace("{", r"\{").replace("}", r"\}")}


def test_auto_finds_hermes_calls_in_free_text(server, client):
    """No tool_choice and no --tool-call-parser (OpenAI's default is "auto"; LangChain and the Agents SDK
    send none): the format comes from the chat template, which writes <tool_call> blocks (hermes). The
    model is steered (a regex constraint) to write a call; the parser turns it into tool_calls."""
    assert server.state.tool_call_parser == "hermes"
    written = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    ask = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=100, extra_body=steer(written))
    reply = client.chat.completions.create(**ask)
    streamed, finish, _ = collect_stream(client.chat.completions.create(**ask, stream=True))
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "add"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
    assert finish == "tool_calls" and [(name, json.loads(arguments)) for _, name, arguments in streamed.values()] == \
        [("add", {"a": 2, "b": 3})]


HERMES_CALL = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 34}}</tool_call>'


@pytest.mark.parametrize("choice,extra,inside_arguments", [
    ({"type": "function", "function": {"name": "add"}}, {}, 8),
    ("required", {}, 30),
    (None, {"extra_body": steer("Let me add. " + HERMES_CALL)}, 42),  # auto, the template's hermes format
])
@pytest.mark.parametrize("cut", ["early", "inside_arguments", "not"])
def test_streamed_and_whole_replies_agree_even_when_max_tokens_cuts_a_call(client, choice, extra, inside_arguments,
                                                                          cut):
    """OpenAI returns a cut call with finish_reason "length"; the stream has sent it as far as it got,
    and the non-streamed message must say the same (LangChain's with_structured_output reads it)."""
    max_tokens = {"early": 3, "inside_arguments": inside_arguments, "not": 1000}[cut]
    ask = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=max_tokens, temperature=0, seed=3, **extra)
    if choice is not None:
        ask["tool_choice"] = choice
    whole = client.chat.completions.create(**ask).choices[0]
    content, finish = "", None
    calls = {}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for streamed in chunk.choices:
            content += streamed.delta.content or ""
            for delta in streamed.delta.tool_calls or []:
                if delta.id:
                    calls[delta.index] = [delta.function.name, ""]
                calls[delta.index][1] += delta.function.arguments or ""
            finish = streamed.finish_reason or finish
    assert finish == whole.finish_reason
    assert (content or None) == whole.message.content
    assert [tuple(c) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    if cut == "inside_arguments":  # the call so far, as OpenAI returns it
        assert whole.finish_reason == "length" and whole.message.tool_calls, whole
        assert whole.message.tool_calls[0].function.name == "add"
        with pytest.raises(json.JSONDecodeError):
            json.loads(whole.message.tool_calls[0].function.arguments)
    elif cut == "not":
        assert whole.finish_reason == "tool_calls"


def test_auto_is_a_400_only_when_the_chat_template_has_no_tool_format(long_context_dir, tmp_path):
    import shutil

    from transformers import AutoTokenizer
    plain = tmp_path / "plain"
    shutil.copytree(long_context_dir, plain)
    tokenizer = AutoTokenizer.from_pretrained(plain)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(plain)
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, "tools": TOOLS}
    with RunningServer(str(plain), name="tiny", block_size=8) as running:
        refused = httpx.post(running.url + "/v1/chat/completions", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"
        assert "--tool-call-parser" in refused.json()["error"]["message"]
        assert httpx.post(running.url + "/v1/chat/completions", json={**body, "tool_choice": "none"}).status_code == 200
    with RunningServer(str(plain), name="tiny", block_size=8, tool_call_parser="hermes") as running:
        assert httpx.post(running.url + "/v1/chat/completions", json=body).status_code == 200


def test_the_tool_call_format_is_read_from_the_chat_template():
    assert parser_for_template("{{ '<tool_call>\\n' + tool_call | tojson }}") == "hermes"
    assert parser_for_template({"default": "[AVAILABLE_TOOLS]...[TOOL_CALLS]", "rag": "x"}) == "mistral"
    assert parser_for_template("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert parser_for_template("{{ messages[0]['content'] }}") is None and parser_for_template(None) is None


def test_parsers_keep_content_and_leave_broken_calls_as_text():
    content, calls = parse_hermes('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]
    assert parse_hermes("<tool_call>{not json") == ("<tool_call>{not json", [])
    content, calls = parse_llama3_json('<|python_tag|>{"name": "f", "parameters": {"s": "a;b"}}; {"name": "g", '
                                       '"parameters": {}}')
    assert content is None and [c.name for c in calls] == ["f", "g"] and json.loads(calls[0].arguments) == {"s": "a;b"}
    assert parse_llama3_json("plain answer") == ("plain answer", [])
    content, calls = parse_mistral('Checking.[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]')
    assert content == "Checking." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]
    assert parse_mistral('[TOOL_CALLS][{"name": "f", "argu') == ('[TOOL_CALLS][{"name": "f", "argu', [])


def replay(plan: ToolPlan, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    """Feed `text` to a ToolStream `step` characters at a time; (content, [(name, arguments)]) sent."""
    stream, content, calls = ToolStream(plan), "", []
    for end in [*range(step, len(text), step), len(text)]:
        delta = stream.update(text[:end], finished=end == len(text)) or {}
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                calls.append([call["function"]["name"], ""])
            calls[call["index"]][1] += call["function"]["arguments"]
    return content, [tuple(c) for c in calls]


@pytest.mark.parametrize("plan,text", [
    (ToolPlan(TOOLS, "named", "add"), ' {"a": 2, "b": 3}'),
    (ToolPlan(TOOLS, "required"), '[{"name": "add", "arguments": {"a": 1, "b": 22}}, '
                                  '{"name": "get_weather", "arguments": {"city": "P\\"a}r,is", "unit": "C"}}]'),
    (ToolPlan(TOOLS, "auto", parser="hermes"), 'Let me check <b>.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'
                                               '</tool_call>\n<tool_call>{"arguments": {"y": [1, {"z": "}"}]}, '
                                               '"name": "g"}</tool_call>'),
    (ToolPlan(TOOLS, "auto", parser="hermes"), "a < b, and <tool"),
    (ToolPlan(TOOLS, "auto", parser="hermes"), "<tool_call>{not json</tool_call>"),
    (ToolPlan(TOOLS, "auto", parser="llama3_json"), '<|python_tag|>{"name": "f", "parameters": {"s": "a;b"}}; '
                                                    '{"name": "g", "parameters": {}}'),
    (ToolPlan(TOOLS, "auto", parser="llama3_json"), "plain answer"),
    (ToolPlan(TOOLS, "auto", parser="llama3_json"), '{"not": "a call"}'),
    (ToolPlan(TOOLS, "auto", parser="mistral"), 'Sure [x].[TOOL_CALLS][{"name": "f", "arguments": {"x": "]"}}, '
                                                '{"name": "g", "arguments": {}}]'),
    (ToolPlan(TOOLS, "auto", parser="mistral"), "no call [TOOL"),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_streamed_reply_adds_up_to_the_parsed_one(plan, text, step):
    """Whatever the pieces the text arrives in, the streamed content and calls are the non-streamed ones."""
    content, calls = replay(plan, text, step)
    expected_content, expected_calls = plan.extract(text)
    assert [(name, json.loads(arguments)) for name, arguments in calls] == \
        [(c.name, json.loads(c.arguments)) for c in expected_calls]
    assert (content.strip() or None) == (expected_content.strip() if expected_content else None)


def test_a_call_is_announced_once_its_name_is_known_and_its_arguments_follow_as_written():
    stream = ToolStream(ToolPlan(TOOLS, "required"))
    assert stream.update('[{"name": "ad', False) is None
    header = stream.update('[{"name": "add", "arguments": {"a"', False)["tool_calls"]
    assert header == [{"index": 0, "id": header[0]["id"], "type": "function",
                       "function": {"name": "add", "arguments": '{"a"'}}]
    assert stream.update('[{"name": "add", "arguments": {"a": 1}', False)["tool_calls"] == \
        [{"index": 0, "function": {"arguments": ": 1}"}}]
