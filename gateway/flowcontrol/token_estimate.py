"""The tokens a request is charged at admission, before the engine reports what it used.

Everything the request may generate is counted: each prompt's completions, `n` of them, each up to
`max_tokens` (DEFAULT_COMPLETION_ESTIMATE without one), plus the prompts themselves (token ids
counted exactly, text at about four characters a token). Counting one prompt and one completion let a
tenant limited to 2,000 tokens a minute make an engine generate 19,200 (issue #34). The charge is
corrected to the reported usage when the response ends (tenant_limits.py).
"""
from __future__ import annotations

DEFAULT_COMPLETION_ESTIMATE = 256  # tokens charged per completion without max_tokens, until usage corrects it
CHARS_PER_TOKEN = 4


def _positive_int(value, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _text_chars(content) -> int:
    """Characters of a message's content: a string, or parts with text (chat's and the Responses API's)."""
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return len(content) if isinstance(content, str) else 0


def prompt_estimates(body: dict) -> list[int]:
    """Estimated tokens of each prompt of the body (one for a chat's messages or a response's input)."""
    if "messages" in body:
        chars = sum(_text_chars(m.get("content")) for m in body.get("messages") or [] if isinstance(m, dict))
        return [chars // CHARS_PER_TOKEN + 1]
    if "input" in body:  # the Responses API: a string, or items (messages, function call outputs)
        items = body["input"] if isinstance(body["input"], list) else [{"content": body["input"]}]
        chars = _text_chars(body.get("instructions")) + sum(
            _text_chars(item.get("content", item.get("output"))) for item in items if isinstance(item, dict))
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
    """Σ prompts + prompts × n × max_tokens."""
    prompts = prompt_estimates(body)
    max_tokens = _positive_int(body.get("max_completion_tokens") or body.get("max_tokens")
                               or body.get("max_output_tokens"), DEFAULT_COMPLETION_ESTIMATE)
    return sum(prompts) + len(prompts) * _positive_int(body.get("n"), 1) * max_tokens
