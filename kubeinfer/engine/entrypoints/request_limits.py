"""Bounds on the work one request may ask of an engine, checked before any of it is done (HTTP and gRPC).

A prompt is tokenized, and its stop strings, stop token ids, allowed token ids and logit biases are
consulted at every generated token: unbounded, one request could hold the tokenizer for minutes or
slow every request of the pod (issue #34). So, before tokenizing:
  * prompt text is at most `max_prompt_chars` characters (by default PROMPT_CHARS_PER_TOKEN times the
    model's context: a prompt that fits the context is far shorter; longer text could never fit);
  * `stop`, `stop_token_ids`, `allowed_token_ids` and `logit_bias` have at most the entries below,
    bounds well above what real clients send (OpenAI itself takes 4 stop sequences);
  * `x-request-timeout-ms` is a positive integer of at most MAX_TIMEOUT_MS.
Each refusal is a ValueError whose message starts with the field it is about (a 400 naming it).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..sampling_params import SamplingParams
from .request_budget import MAX_TIMEOUT_MS, TIMEOUT_HEADER

PROMPT_CHARS_PER_TOKEN = 10  # generous: English averages about 4 characters a token, code and CJK fewer
MAX_STOP_STRINGS = 32  # each costs a search at every token: the product of the two bounds the cost
MAX_STOP_STRING_CHARS = 128
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024


def max_prompt_chars(max_model_len: int, configured: int | None = None) -> int:
    """The character bound on a request's prompt text: `configured` (--max-prompt-chars), else derived."""
    return configured if configured else PROMPT_CHARS_PER_TOKEN * max_model_len


def check_prompt_chars(texts: Iterable[str], limit: int, field: str = "prompt") -> None:
    """ValueError when any prompt text (or, for chat, the messages together) is over `limit` characters."""
    for text in texts:
        if len(text) > limit:
            raise ValueError(f"{field}: {len(text)} characters is over this server's limit of {limit} "
                             f"({PROMPT_CHARS_PER_TOKEN} per token of the model's context, or --max-prompt-chars)")


def check_sampling_lists(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming the field when a list the engine consults per token is over its bound."""
    stops = params.stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(f"stop: a stop string is at most {MAX_STOP_STRING_CHARS} characters, got {longest}")
    if len(params.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(params.stop_token_ids)}")
    if len(params.logit_bias or {}) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(params.logit_bias)}")
    allowed = params.allowed_token_ids or ()
    if len(allowed) > vocab_size:  # more ids than the vocabulary has can only be repeats
        raise ValueError(f"allowed_token_ids: at most the vocabulary's {vocab_size} ids, got {len(allowed)}")


def check_timeout_header(headers: Mapping[str, str]) -> None:
    """ValueError naming x-request-timeout-ms unless it is absent or a positive integer of at most a day."""
    value = headers.get(TIMEOUT_HEADER)
    if value is None:
        return
    text = value.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 12 and 0 < int(text) <= MAX_TIMEOUT_MS):
        shown = value if len(value) <= 32 else value[:32] + "..."
        raise ValueError(f"{TIMEOUT_HEADER}: must be a positive integer of milliseconds, at most {MAX_TIMEOUT_MS}, "
                         f"got {shown!r}")


def chat_text(messages) -> str:
    """The client's text in chat messages (contents, text parts, tool-call arguments), for the bound."""
    parts: list[str] = []
    for message in messages:
        content = message.content
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
        for call in message.tool_calls or ():
            parts.append(str((call.get("function") or {}).get("arguments", "")) if isinstance(call, dict) else "")
    return "".join(parts)
