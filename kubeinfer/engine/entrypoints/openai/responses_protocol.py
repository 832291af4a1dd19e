"""The body of `POST /v1/responses` (OpenAI's Responses API, stateless) and its translation into the chat
completion it runs as: `input` items become messages, function tools and tool_choice take chat's shape,
`text.format` becomes `response_format`, `max_output_tokens` becomes `max_tokens`. Whatever chat
checks (sampling ranges, schemas, tools) it checks here too, with the 400 naming the Responses field.

Nothing is stored: `previous_response_id`, `store: true`, `conversation` and `background` are a 400
that says so; send the whole conversation in `input` instead (the Agents SDK does by default).
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field, model_validator

from .protocol import SamplingExtras
from .protocol_base import NOT_YET, Trivial, one_of, unset, warn_about_ignored_fields

STATELESS = "this server stores no responses; send the whole conversation in input"

# Passed on to the chat completion as they are: the sampling fields chat shares (vLLM's extras among them;
# guidellm sends ignore_eos and stop to /v1/responses) and chat's own fields of the same meaning.
PASSED_TO_CHAT = (*SamplingExtras.model_fields, "parallel_tool_calls", "chat_template_kwargs", "stream")
# Chat's field names in its errors, as this body calls them.
PARAM_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input",
               "reasoning_effort": "reasoning"}


def not_true(value: Any, _: dict) -> bool:
    return value is None or value is False


class ResponsesRequest(SamplingExtras):
    refused: ClassVar[dict[str, tuple[Trivial, str]]] = {
        "previous_response_id": (unset, STATELESS), "store": (not_true, STATELESS + "; store must be false"),
        "conversation": (unset, STATELESS), "background": (not_true, STATELESS + "; background must be false"),
        "prompt": (unset, NOT_YET + ": stored prompt templates"), "include": (unset, NOT_YET),
        "truncation": (one_of("disabled"), NOT_YET + '; only "disabled"'), "max_tool_calls": (unset, NOT_YET),
        "top_logprobs": (one_of(0), NOT_YET), "context_management": (unset, NOT_YET),
    }

    model: str
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    # Accepted: they do not change what is generated (metadata is echoed in the response).
    stream_options: Any = None
    metadata: dict[str, str] | None = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    service_tier: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # effort, to templates that read it (chat's reasoning_effort)
    # Refused unless trivial (`refused`); declared so that the 400 names them.
    previous_response_id: Any = None
    store: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    include: Any = None
    truncation: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    context_management: Any = None

    @model_validator(mode="after")
    def _warn_about_ignored_fields(self):
        warn_about_ignored_fields(self)
        return self

    def chat_body(self) -> dict[str, Any]:
        """The chat completion this response runs as (validated by ChatCompletionRequest afterwards).
        ValueError naming a Responses field for what chat cannot express."""
        body: dict[str, Any] = {"model": self.model, "messages": self.messages(), "max_tokens": self.max_output_tokens}
        body.update({name: getattr(self, name) for name in PASSED_TO_CHAT if name in self.model_fields_set})
        if self.stream:  # the usage is reported in response.completed
            body["stream_options"] = {"include_usage": True}
        reasoning = self.reasoning or {}
        if reasoning.get("summary") not in (None, "auto"):
            raise ValueError(f'reasoning: summary {reasoning["summary"]!r} is {NOT_YET}; the thinking itself is the '
                             "reasoning item's content")
        if reasoning.get("effort") is not None:
            body["reasoning_effort"] = reasoning["effort"]
        if self.tools is not None:
            body["tools"] = [chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        if response_format := self.response_format():
            body["response_format"] = response_format
        return body

    def messages(self) -> list[dict[str, Any]]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for index, item in enumerate(items):
            add_item(messages, item, f"input[{index}]")
        return messages

    def response_format(self) -> dict[str, Any] | None:
        text = self.text or {}
        if text.get("verbosity") not in (None, "medium"):
            raise ValueError(f"text.verbosity: {NOT_YET}; only \"medium\"")
        fmt = text.get("format") or {"type": "text"}
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise ValueError("text.format: a json_schema format needs its schema object in \"schema\"")
            return {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "response"), "schema": fmt["schema"], "strict": fmt.get("strict")}}
        raise ValueError(f'text.format: type must be "text", "json_object" or "json_schema", got {kind!r}')


def add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """One input item as chat messages: a message, an earlier function call (joined to the assistant
    message before it) or a function call's output (a tool message)."""
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role") not in ("user", "assistant", "system", "developer"):
            raise ValueError(f"input: {where}.role must be user, assistant, system or developer")
        messages.append({"role": item["role"], "content": text_of(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
        if not isinstance(call["id"], str) or not isinstance(call["function"]["name"], str):
            raise ValueError(f"input: {where} (a function_call) needs call_id and name")
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": None}
            messages.append(last)
        last.setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise ValueError(f"input: {where} (a function_call_output) needs call_id")
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": text_of(item.get("output"), f"{where}.output")})
    elif kind == "reasoning":
        pass  # earlier thinking is not fed back: chat templates drop it from past turns too
    elif kind == "item_reference":
        raise ValueError(f"input: {where} is an item_reference; {STATELESS}")
    else:
        raise ValueError(f"input: {where} has type {kind!r}; only message, function_call, function_call_output "
                         "and reasoning items are served")


def text_of(content: Any, where: str) -> str:
    """A message's text: a string, or text parts (input_text, output_text, refusal)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"input: {where} must be a string or a list of content parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise ValueError(f"input: {where} has a part of type {kind!r}; the models served take text only")
        texts.append(part.get("refusal" if kind == "refusal" else "text") or "")
    return "".join(texts)


def chat_tool(tool: Any, index: int) -> dict[str, Any]:
    """A Responses function tool (flat: type, name, parameters) in chat's shape."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise ValueError(f"tools: tools[{index}] has type {kind!r}; only function tools are served")
    function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        raise ValueError(f"tool_choice: allowed_tools is {NOT_YET}")
    return choice  # "none" | "auto" | "required"; anything else is chat's 400
