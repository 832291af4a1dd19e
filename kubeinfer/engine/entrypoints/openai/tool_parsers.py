"""Finding tool calls in a model's free text (`tool_choice: "auto"`), one parser per model family's
format, chosen by `--tool-call-parser NAME` as in vLLM:
  * `hermes` (Qwen 2/2.5/3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks;
    the text outside them is the content.
  * `llama3_json` (Llama 3.1+): the reply is one JSON call `{"name": ..., "parameters": {...}}`, or
    several separated by `;`, optionally after `<|python_tag|>`.
  * `mistral` (Mistral, Mixtral, Ministral): `[TOOL_CALLS]` then a JSON array of
    `{"name": ..., "arguments": {...}}`; the text before the tag is the content.
A block that is not valid JSON is left in the content: the client sees what the model wrote.
Without `--tool-call-parser`, `parser_for_template` picks the format the model's chat template writes.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls, kept, last = [], [], 0
    for match in HERMES_BLOCK.finditer(text):
        call = _call(match.group(1), "arguments")
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = [_call(part, "parameters") for part in _split_json_objects(body)]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, calls


MISTRAL_TAG = "[TOOL_CALLS]"


def parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    head, tag, tail = text.partition(MISTRAL_TAG)
    if not tag:
        return text, []
    try:
        items = json.loads(tail)
    except json.JSONDecodeError:
        return text, []
    calls = [_call(json.dumps(item), "arguments") for item in (items if isinstance(items, list) else [items])]
    if not calls or any(c is None for c in calls):
        return text, []
    return head.strip() or None, calls


def _call(text: str, arguments_key: str) -> ToolCall | None:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get(arguments_key, data.get("arguments", {}))
    return ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False))


def _split_json_objects(text: str) -> list[str]:
    """`{...}; {...}` -> the objects' texts (decoded one after another, so `;` inside strings is safe)."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            _, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return [text]
        parts.append(text[at:end])
        at = end
        while at < len(text) and text[at] in " \n\t;":
            at += 1
    return parts


PARSERS: dict[str, Callable[[str], tuple[str | None, list[ToolCall]]]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}
# Parsers whose tag is a special token: the reply is detokenized with special tokens kept for them.
KEEPS_SPECIAL_TOKENS = {"mistral"}

# What a chat template writes when it renders an assistant's tool call, most specific first.
TEMPLATE_MARKERS = (("<tool_call>", "hermes"), (MISTRAL_TAG, "mistral"), ("<|python_tag|>", "llama3_json"))


def parser_for_template(template: str | dict | None) -> str | None:
    """The tool-call format a chat template writes (`tokenizer.chat_template`, a string or named
    templates), or None when it renders no tool calls."""
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    for marker, parser in TEMPLATE_MARKERS:
        if template and marker in template:
            return parser
    return None
