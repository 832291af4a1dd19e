"""The tokens a request is charged at admission, before the engine reports what it used.

Everything the request may generate is counted: each prompt's completions, `n` of them, each up to the
completion budget the engine will honour (DEFAULT_COMPLETION_ESTIMATE without one), plus the prompts
themselves (token ids counted exactly, text at about four characters a token). Counting one prompt and one
completion let a tenant limited to 2,000 tokens a minute make an engine generate 19,200 (issue #34). The
charge is corrected to the reported usage when the response ends (tenant_limits.py).

The budget is read as the engine reads it: a Responses body (`input`, no `messages`) has only
`max_output_tokens` and one completion (a `max_tokens: 1` beside it is ignored by the engine, so it must be
here too: issue #44), chat `max_completion_tokens` before `max_tokens`. Every text the engine renders into
the prompt is counted: message contents, tool calls' names and arguments, function call outputs.
"""
from __future__ import annotations

DEFAULT_COMPLETION_ESTIMATE = 256  # tokens charged per completion without max_tokens, until usage corrects it
CHARS_PER_TOKEN = 4


def _positive_int(value, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _text_chars(content) -> int:
    """Characters of a text field: a string, or parts with text or a refusal (chat's and the Responses API's)."""
    if isinstance(content, list):
        return sum(len(str(p.get("text") or p.get("refusal") or "")) for p in content if isinstance(p, dict))
    return len(content) if isinstance(content, str) else 0


def _call_chars(function) -> int:
    """A tool call's name and arguments (a JSON string; anything else counted as its text)."""
    if not isinstance(function, dict):
        return 0
    arguments = function.get("arguments")
    return _text_chars(function.get("name")) + (len(arguments) if isinstance(arguments, str)
                                                else len(str(arguments)) if arguments is not None else 0)


def _message_chars(message) -> int:
    if not isinstance(message, dict):
        return 0
    calls = message.get("tool_calls") if isinstance(message.get("tool_calls"), list) else []
    return _text_chars(message.get("content")) + sum(
        _call_chars(call.get("function")) for call in calls if isinstance(call, dict))


def _input_item_chars(item) -> int:
    """A Responses input item as the engine renders it: a message's content, a function call's name and
    arguments, a function call's output (reasoning items are not fed back)."""
    if not isinstance(item, dict):
        return 0
    kind = item.get("type", "message")
    if kind == "function_call":
        return _call_chars(item)
    if kind == "function_call_output":
        return _text_chars(item.get("output"))
    return _text_chars(item.get("content")) if kind == "message" else 0


def is_responses_body(body: dict) -> bool:
    return "input" in body and "messages" not in body


def completion_budget(body: dict) -> int | None:
    """The completion tokens per prompt the engine will allow, as it reads this body; None without a limit."""
    if is_responses_body(body):
        return _positive_int(body.get("max_output_tokens"), None)
    return _positive_int(body.get("max_completion_tokens") or body.get("max_tokens"), None)


def prompt_estimates(body: dict) -> list[int]:
    """Estimated tokens of each prompt of the body (one for a chat's messages or a response's input)."""
    if "messages" in body:
        messages = body.get("messages")
        chars = sum(_message_chars(m) for m in messages) if isinstance(messages, list) else 0
        return [chars // CHARS_PER_TOKEN + 1]
    if "input" in body:  # the Responses API: a string, or items (messages, function calls and their outputs)
        given = body["input"]
        items = given if isinstance(given, list) else [{"content": given}]
        chars = _text_chars(body.get("instructions")) + sum(_input_item_chars(item) for item in items)
        return [chars // CHARS_PER_TOKEN + 1]
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return [len(prompt) // CHARS_PER_TOKEN + 1]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [len(prompt)]  # one prompt of token ids
    if isinstance(prompt, list):
        return [len(p) // CHARS_PER_TOKEN + 1 if isinstance(p, str) else len(p) if isinstance(p, list) else 1
                for p in prompt] or [1]
    return [1]


def estimate_request_tokens(body: dict) -> int:
    """Σ prompts + prompts × n × the completion budget (a response has one completion: the engine has no `n`)."""
    prompts = prompt_estimates(body)
    n = 1 if is_responses_body(body) else _positive_int(body.get("n"), 1)
    return sum(prompts) + len(prompts) * n * (completion_budget(body) or DEFAULT_COMPLETION_ESTIMATE)
