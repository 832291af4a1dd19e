"""Tool calls streamed the way OpenAI streams them: a call's first delta carries its index, id, type and
name (`"arguments": ""`), the next ones carry fragments of its arguments' JSON text, and the finish
reason comes last. Text outside calls streams as `content`.

Each update re-reads the whole reply so far (replies are short; a rescan keeps no fragile state) into
content and partial calls, and sends what was not sent yet. Only what can no longer change is sent: a
call once its name is complete, arguments as the raw text the model wrote (a prefix of their final
text), content up to a possible start of `<tool_call>`. A call the parser later finds broken has
already been sent; the non-streamed reply leaves such a block in the content instead (vLLM streams
the same way).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .tool_calls import ToolPlan, tool_call_json
from .tool_parsers import MISTRAL_TAG, ToolCall

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
WHITESPACE = " \t\n\r"


@dataclass
class PartialCall:
    name: str | None = None
    arguments: str = ""  # the raw JSON text of the arguments written so far


@dataclass
class ToolStream:
    """What one streamed choice has sent; `update` gives the next delta (or None when nothing is new)."""
    plan: ToolPlan
    sent_content: int = 0
    sent_arguments: list[int] = field(default_factory=list)  # per call whose header went out

    @property
    def called(self) -> bool:
        return bool(self.sent_arguments)

    def update(self, text: str, finished: bool) -> dict | None:
        content, calls = read_reply(self.plan, text, finished)
        if finished and not self.called and not any(call.name for call in calls):
            content = text  # no call after all: everything held back is content
        delta: dict = {}
        if len(content) > self.sent_content:
            delta["content"] = content[self.sent_content:]
            self.sent_content = len(content)
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # calls are announced in order, each once its name is known
            if index == len(self.sent_arguments):
                header = tool_call_json(ToolCall(call.name, ""), index)
                self.sent_arguments.append(0)
                deltas.append(header)
            fragment = call.arguments[self.sent_arguments[index]:]
            if fragment:
                self.sent_arguments[index] = len(call.arguments)
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += fragment
                else:
                    deltas.append({"index": index, "function": {"arguments": fragment}})
        if deltas:
            delta["tool_calls"] = deltas
        return delta or None


def read_reply(plan: ToolPlan, text: str, finished: bool) -> tuple[str, list[PartialCall]]:
    """(content that can be sent, calls so far) of a reply in progress, by the plan's format."""
    if plan.choice == "named":  # the whole reply is the arguments
        return "", [PartialCall(plan.named, text.strip())]  # trailing space waits: a string may go on
    if plan.choice == "required":
        return "", _read_call_list(text)
    if plan.parser == "hermes":
        return _read_hermes(text, finished)
    if plan.parser == "mistral":
        return _read_mistral(text, finished)
    return _read_llama3(text, finished)


def final_reply(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of the non-streamed message: what the stream sends for the same reply, so the
    two agree to the character. A reply that ended by itself keeps a call only when the parser finds
    it whole (ToolPlan.extract); one cut short (max_tokens) keeps the calls whose names were written,
    with their arguments as far as they got, as OpenAI returns them."""
    if finish_reason == "stop" and not plan.extract(text)[1]:
        return text, []
    content, calls = read_reply(plan, text, True)
    named = []
    for call in calls:
        if call.name is None:
            break
        named.append(ToolCall(call.name, call.arguments))
    if not named:
        return text, []
    return content or None, named


def _read_mistral(text: str, finished: bool) -> tuple[str, list[PartialCall]]:
    """Content, then `[TOOL_CALLS]` and a JSON array of calls."""
    start = text.find(MISTRAL_TAG)
    if start < 0:
        return (text if finished else text[:len(text) - open_tag_prefix(text, MISTRAL_TAG)]), []
    body = text[start + len(MISTRAL_TAG):]
    return text[:start], _read_call_list(body)


def _read_call_list(text: str) -> list[PartialCall]:
    """`[{"name": ..., "arguments": {...}}, ...]`, the grammar's shape for `required`."""
    calls: list[PartialCall] = []
    at = _skip(text, 0)
    if at >= len(text) or text[at] != "[":
        return calls
    at += 1
    while True:
        at = _skip(text, at, WHITESPACE + ",")
        if at >= len(text) or text[at] != "{":
            return calls
        call, at = _read_call(text, at, ("arguments",))
        if call is None:
            return calls
        calls.append(call)
        if at is None:
            return calls


def _read_hermes(text: str, finished: bool) -> tuple[str, list[PartialCall]]:
    content, calls, at = [], [], 0
    while True:
        start = text.find(HERMES_OPEN, at)
        if start < 0:
            tail = text[at:]
            content.append(tail if finished else tail[:len(tail) - open_tag_prefix(tail, HERMES_OPEN)])
            break
        content.append(text[at:start])
        body = _skip(text, start + len(HERMES_OPEN))
        if body >= len(text):
            break
        call, end = _read_call(text, body, ("arguments",)) if text[body] == "{" else (None, None)
        if call is None:  # a broken block is text, as the non-streamed parser leaves it
            content.append(text[start:])
            break
        calls.append(call)
        if end is None:
            break
        end = _skip(text, end)
        if text.startswith(HERMES_CLOSE, end):
            end += len(HERMES_CLOSE)
        elif not finished and HERMES_CLOSE.startswith(text[end:]):
            break  # the closing tag is still being written
        at = end
    return "".join(content), calls


def _read_llama3(text: str, finished: bool) -> tuple[str, list[PartialCall]]:
    """One or more `{"name": ..., "parameters": {...}}` separated by `;`, maybe after <|python_tag|>;
    any other reply is content. Held back until its first character says which."""
    body = text.lstrip()
    if not finished and (not body or (PYTHON_TAG.startswith(body) and body != PYTHON_TAG)):
        return "", []
    body = body.removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return ("" if not finished and not body else text), []
    offset = len(text) - len(body)
    calls, at = [], offset
    while at is not None:
        at = _skip(text, at, WHITESPACE + ";")
        if at >= len(text) or text[at] != "{":
            break
        call, at = _read_call(text, at, ("parameters", "arguments"))
        if call is None:
            break
        calls.append(call)
    return "", calls


def _read_call(text: str, at: int, argument_keys: tuple[str, ...]) -> tuple[PartialCall | None, int | None]:
    """The call object starting at text[at] == "{": (call so far, index after it or None while it is
    unfinished); (None, None) when it is not a call object."""
    call, at = PartialCall(), at + 1
    while True:
        at = _skip(text, at, WHITESPACE + ",")
        if at >= len(text):
            return call, None
        if text[at] == "}":
            return call, at + 1
        if text[at] != '"':
            return None, None
        key_end = _value_end(text, at)
        if key_end is None:
            return call, None
        key = json.loads(text[at:key_end])
        at = _skip(text, key_end)
        if at >= len(text):
            return call, None
        if text[at] != ":":
            return None, None
        at = _skip(text, at + 1)
        if at >= len(text):
            return call, None
        end = _value_end(text, at)
        if key in argument_keys:
            call.arguments = text[at:end] if end is not None else text[at:].rstrip(WHITESPACE)
        elif key == "name" and end is not None:
            name = json.loads(text[at:end])
            if not isinstance(name, str):
                return None, None
            call.name = name
        if end is None:
            return call, None
        at = end


def _value_end(text: str, at: int) -> int | None:
    """Index just after the JSON value starting at text[at], or None while it is unfinished."""
    depth, i = 0, at
    while i < len(text):
        char = text[i]
        if char == '"':
            i += 1
            while i < len(text) and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            if i >= len(text):
                return None
            if depth == 0:
                return i + 1
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1 if depth == 0 else i
        elif depth == 0 and char in ", \t\n\r":
            return i  # the end of a number, true, false or null
        i += 1
    return None


def _skip(text: str, at: int, chars: str = WHITESPACE) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def open_tag_prefix(text: str, tag: str) -> int:
    """How many trailing characters of text could begin `tag` (held back until the next update)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
