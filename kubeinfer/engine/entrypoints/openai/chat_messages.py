"""Chat completion messages as chat templates take them, and the keyword arguments a client may pass
to the model's template (`chat_template_kwargs`)."""
from __future__ import annotations

import json
from typing import Any, Literal

from .protocol_base import RequestModel


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer names the call
    name: str | None = None

    def for_template(self) -> dict:
        """The message as chat templates take it (a call's JSON-string arguments as an object)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text is understood by our models
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"messages: content part type {part.get('type')!r} is not supported; only text")
                parts.append(part.get("text", ""))
            return "".join(parts)
        return self.content or ""


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError:
            pass  # the template gets the text as the client sent it
    return {**call, "function": function}


# apply_chat_template's own parameters and the names transformers passes to every template.
TEMPLATE_RESERVED_KWARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs", "kwargs", "raise_exception",
    "strftime_now", "bos_token", "eos_token", "unk_token", "pad_token"))
MAX_TEMPLATE_KWARG_CHARS = 1024




def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """Switches the model's template reads (`enable_thinking`...), never what apply_chat_template
    treats itself (a template of the client's, tools, tokenizing): vLLM's CVE-2025-61620."""
    for key, value in kwargs.items():
        if key in TEMPLATE_RESERVED_KWARGS:
            raise ValueError(f"{key!r} cannot be set here; it is the server's (or a request field)")
        if not (value is None or isinstance(value, (bool, int, float))
                or (isinstance(value, str) and len(value) <= MAX_TEMPLATE_KWARG_CHARS)):
            raise ValueError(f"{key!r} must be a boolean, a number, null or a string of at most "
                             f"{MAX_TEMPLATE_KWARG_CHARS} characters")
