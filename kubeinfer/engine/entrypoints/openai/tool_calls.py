"""Tool calling on chat completions: `tools`, `tool_choice`, `parallel_tool_calls`, as OpenAI defines them.

`ToolPlan.of(body, parser)` decides, before any work, how a request calls tools:
  * `none` (the default without tools): tools are not rendered; the reply is text.
  * a named function: decoding is constrained to that function's parameter schema, so its arguments
    always validate; the whole output is the call's arguments.
  * `required`: decoding is constrained to a JSON array of calls `[{"name", "arguments"}]` (one at most
    with `parallel_tool_calls: false`), each arguments object constrained to its function's schema.
  * `auto` (the default with tools, as in OpenAI's API): free decoding, then the server's tool-call
    parser (tool_parsers: `--tool-call-parser`, or the format the model's chat template writes) finds
    the calls in the text; a 400 only when the model has no tool-call format.
The tools go to the chat template (transformers' `apply_chat_template(tools=...)`); a reply with calls
carries `tool_calls` (ids, JSON-string arguments) and `finish_reason: "tool_calls"`.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from ...sampling_params import StructuredOutputsParams
from .tool_parsers import PARSERS, ToolCall


@dataclass
class ToolPlan:
    tools: list[dict]  # OpenAI's {"type": "function", "function": {...}}, as the template takes them
    choice: str  # "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True
    parser: str | None = None  # for "auto"

    @classmethod
    def of(cls, body: Any, parser: str | None) -> ToolPlan | None:
        """The request's plan, or None when it calls no tools; ValueError naming `tools`/`tool_choice`."""
        tools = _check_tools(body.tools)
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
        if choice == "none":
            return None
        if not tools:
            raise ValueError(f"tool_choice: {json.dumps(choice)} needs tools")
        parallel = body.parallel_tool_calls is not False
        names = [t["function"]["name"] for t in tools]
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if name not in names:
                raise ValueError(f"tool_choice: names no function of tools ({', '.join(names)}): {json.dumps(choice)}")
            return cls(tools, "named", name, parallel)
        if choice == "required":
            return cls(tools, "required", None, parallel)
        if choice == "auto":
            if parser is None:
                raise ValueError('tool_choice: "auto" needs a tool-call format, and this model\'s chat template '
                                 "writes none that the server knows; start it with --tool-call-parser NAME, or "
                                 'use "required" or a named function')
            return cls(tools, "auto", None, parallel, parser)
        raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, got {json.dumps(choice)}')

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that makes the output a valid call (named, required); None for auto."""
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.choice == "named":
            return StructuredOutputsParams(json=params[self.named], field="tool_choice")
        if self.choice == "required":
            call = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                     "required": ["name", "arguments"], "additionalProperties": False}
                    for name, schema in params.items()]
            array = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array, field="tool_choice")
        return None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a reply that ended by itself; a reply that is not a complete call stays text.
        (The message sent is tool_stream.final_reply: the calls found here, as the stream sent them.)"""
        try:
            if self.choice == "named":
                return None, [ToolCall(self.named, json.dumps(json.loads(text), ensure_ascii=False))]
            if self.choice == "required":
                return None, [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                              for c in json.loads(text)]
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []  # cut short (max_tokens): what was written is returned as text
        content, calls = PARSERS[self.parser](text)
        return content, calls if self.parallel else calls[:1]


def tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def _check_tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools: each tool must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                             f"got {json.dumps(tool)[:200]}")
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"tools: the parameters of {function['name']!r} must be a JSON Schema object")
    return tools
