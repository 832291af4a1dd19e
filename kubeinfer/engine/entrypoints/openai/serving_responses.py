"""`POST /v1/responses`: OpenAI's Responses API, stateless, run as the chat completion it translates to
(responses_protocol), so templates, tools, reasoning, structured output, admission and usage are chat's.

The reply comes back as a `response` object whose `output` holds a reasoning item (with a reasoning
parser), a message item with the text, and one function_call item per tool call. Streamed, it comes
as the typed events the `openai` client assembles: response.created and .in_progress, then per item
output_item.added, its deltas (output_text, reasoning_text, function_call_arguments) and .done events,
output_item.done, and response.completed (or .incomplete when max_output_tokens cut it, .failed on an
engine error). The events are read off chat's streamed deltas, so a streamed response and a whole one
carry the same items to the character.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from ...core.outputs import RequestOutput
from .errors import APIError, param_of
from .json_body import OFF_LOOP_BYTES
from .protocol import ChatCompletionRequest
from .responses_protocol import PARAM_NAMES, ResponsesRequest
from .server_state import ServerState
from .serving_chat import ChatFormat, chat_prompt, tool_plan
from .serving_engine import check_serving, prepare_all, respond, to_params


async def create_response(state: ServerState, body: ResponsesRequest, request: Request):
    def as_chat() -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate(body.chat_body())

    try:
        # A large body's translation and validation take the CPU for seconds: off the loop, as json_body.py
        # does for the other routes (issue #44: a 4.1 MB body held /health for 2.5 s).
        large = len(await request.body()) > OFF_LOOP_BYTES
        chat = await asyncio.to_thread(as_chat) if large else as_chat()
        lora_id = check_serving(state, chat)
        params = to_params(chat, chat.effective_max_tokens(), None)
        tools = tool_plan(state, chat, params)
    except (ValueError, APIError) as error:  # chat's checks, named as this body names its fields
        raise as_responses_error(error) from error
    prepared = await prepare_all(state, chat, lambda: [{"prompt_token_ids": chat_prompt(state, chat, tools)}], params,
                                 "resp", lora_id)
    fmt = ResponsesFormat(chat.model, False, tools=tools, reasoning=state.reasoning_parser, request=body,
                          tokenizer=state.engine.tokenizer)
    return await respond(state, request, chat, prepared, fmt)


def as_responses_error(error: ValueError | APIError) -> APIError:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        location = [str(p) for p in first.get("loc", ())]
        param = PARAM_NAMES.get(location[0], location[0]) if location else None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        return APIError(400, f"{param}: {message}" if param else message, param)
    if isinstance(error, APIError):
        if error.param not in PARAM_NAMES:
            return error
        name = PARAM_NAMES[error.param]
        return APIError(error.status, error.message.replace(error.param, name, 1), name, error.headers)
    message = str(error)
    param = message.split(":", 1)[0] if ":" in message.split(" ", 1)[0] else param_of(message)
    return APIError(400, message, param)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class ResponsesFormat(ChatFormat):
    """Chat's format (chunks, tool and reasoning streams), answered as a Responses `response`."""
    request: ResponsesRequest | None = None
    tokenizer: Any = None
    created: int = field(default_factory=lambda: int(time.time()))

    def full_response(self, request_id: str, outputs: list[RequestOutput], n: int) -> dict:
        chat = super().full_response(request_id, outputs, n)
        choice = chat["choices"][0]
        status = response_status(choice["finish_reason"])
        items = output_items(choice["message"], status)
        return self.response(request_id, status, items, chat["usage"], choice["finish_reason"])

    def response(self, request_id: str, status: str, output: list[dict], usage: dict | None,
                 finish_reason: str | None = None) -> dict:
        body = self.request
        reasoning = "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item["content"])
        return {
            "id": request_id.replace("-", "_"), "object": "response", "created_at": self.created, "status": status,
            "model": body.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens" if finish_reason == "length" else finish_reason}
            if status == "incomplete" else None,
            "usage": usage and responses_usage(usage, len(self.tokenizer.encode(reasoning, add_special_tokens=False))
                                               if reasoning and self.tokenizer else 0),
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": body.reasoning, "store": False, "background": False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "truncation": "disabled",
            "user": body.user}

    async def events(self, request_id: str, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        stream = EventStream(self, request_id)
        yield stream.event("response.created", response=self.response(request_id, "in_progress", [], None))
        yield stream.event("response.in_progress", response=self.response(request_id, "in_progress", [], None))
        usage, finish_reason = None, None
        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"]
                yield stream.event("error", code=str(error["code"]), message=error["message"], param=None)
                failed = self.response(request_id, "failed", stream.items, None)
                failed["error"] = {"code": "server_error", "message": error["message"]}
                yield stream.event("response.failed", response=failed)
                return
            if not chunk["choices"]:
                usage = chunk.get("usage")
                continue
            for choice in chunk["choices"]:
                for event in stream.on_delta(choice["delta"]):
                    yield event
                finish_reason = choice["finish_reason"] or finish_reason
        status = response_status(finish_reason)
        for event in stream.close(status):
            yield event
        final = self.response(request_id, status, stream.items, usage, finish_reason)
        yield stream.event("response.completed" if status == "completed" else f"response.{status}", response=final)


def response_status(finish_reason: str | None) -> str:
    return "completed" if finish_reason in ("stop", "tool_calls") else "incomplete"


def responses_usage(usage: dict, reasoning_tokens: int) -> dict:
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage["total_tokens"]}


def reasoning_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def function_call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(message: dict, status: str) -> list[dict]:
    """A chat message's reasoning, text and tool calls as output items; the last is the one a cut left
    incomplete."""
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(message["reasoning"], "completed"))
    if message.get("content"):
        items.append(message_item(message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        items.append(function_call_item(call["id"], call["function"]["name"], call["function"]["arguments"], "completed"))
    if items and status == "incomplete":
        items[-1]["status"] = "incomplete"
    return items


# What each kind of item streams: its delta event, the field that grows, and how its parts are announced.
DELTA_EVENTS = {"reasoning": "response.reasoning_text", "message": "response.output_text",
                "function_call": "response.function_call_arguments"}


@dataclass
class EventStream:
    """Turns chat's streamed deltas into Responses events: one item open at a time (reasoning, then
    text, then each call), closed with its .done events when the next begins or the reply ends."""
    fmt: ResponsesFormat
    request_id: str
    items: list[dict] = field(default_factory=list)
    open: dict | None = None
    sequence: int = 0

    def event(self, kind: str, **payload: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def on_delta(self, delta: dict) -> list[str]:
        events = []
        if delta.get("reasoning"):
            events += self._grow("reasoning", delta["reasoning"], lambda: reasoning_item("", "in_progress"))
        if delta.get("content"):
            events += self._grow("message", delta["content"], lambda: message_item("", "in_progress"))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):  # a new call: its header comes first
                events += self._close("completed")
                events += self._begin(function_call_item(call["id"], function.get("name"), "", "in_progress"))
            if function.get("arguments"):
                events += self._grow("function_call", function["arguments"], None)
        return events

    def close(self, status: str) -> list[str]:
        return self._close(status)

    def _grow(self, kind: str, text: str, new_item) -> list[str]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close("completed") + self._begin(new_item())
        item = self.open
        location = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if kind == "function_call":
            item["arguments"] += text
            return events + [self.event(DELTA_EVENTS[kind] + ".delta", **location, delta=text)]
        item["content"][0]["text"] += text
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self.event(DELTA_EVENTS[kind] + ".delta", **location, content_index=0, delta=text, **extra)]

    def _begin(self, item: dict) -> list[str]:
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        announced = {**item, "content": []} if "content" in item else item  # its parts are announced next
        events = [self.event("response.output_item.added", output_index=index, item=announced)]
        for part_index, part in enumerate(item.get("content", [])):
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=part_index, part=part))
        return events

    def _close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index = self.items.index(item)
        location = {"item_id": item["id"], "output_index": index}
        kind = DELTA_EVENTS[item["type"]]
        if item["type"] == "function_call":
            events = [self.event(kind + ".done", **location, name=item["name"], arguments=item["arguments"])]
        else:
            part = item["content"][0]
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events = [self.event(kind + ".done", **location, content_index=0, text=part["text"], **extra),
                      self.event("response.content_part.done", **location, content_index=0, part=part)]
        return events + [self.event("response.output_item.done", output_index=index, item=item)]
