"""Outputs on their way out, shared by completions and chat: the output streams of a body's prompts
merged into one, Server-Sent Events (one `data:` line per chunk, ending in `data: [DONE]`) and the
`usage` block. A format object (CompletionFormat, ChatFormat) says what each chunk looks like; this
module decides which chunks to send; request_budget.py ends a request whose time budget is spent.
"""
from __future__ import annotations

import json

from ...core.async_engine import AsyncEngine
from ...core.errors import EngineDeadError, RequestFailedError
from ...core.outputs import RequestOutput
from ..request_budget import merged
from .errors import ERROR_TYPES


async def stream_sse(chunks):
    """Chunks as Server-Sent Events, ending in `data: [DONE]` (completions and chat)."""
    async for chunk in chunks:
        yield sse(chunk)
    yield "data: [DONE]\n\n"


async def stream_chunks(engine: AsyncEngine, requests, fmt, request_id: str, n: int, include_usage: bool,
                        deadline: float | None = None, continuous_usage: bool = False):
    """The chunks of a streamed reply, then the usage chunk if asked; an error is a last chunk of its own.
    `continuous_usage` (vLLM's stream_options.continuous_usage_stats): every chunk also carries the
    usage so far, the whole body's prompt tokens and the completion tokens generated until then."""
    sent_text: dict[tuple[int, int], int] = {}
    sent_tokens: dict[tuple[int, int], int] = {}
    finals: dict[int, RequestOutput] = {}
    prompt_tokens = sum(len(request.prompt_token_ids) for request, _ in requests)

    def with_usage(chunk: dict) -> dict:
        if continuous_usage:
            completion_tokens = sum(sent_tokens.values())
            chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}
        return chunk

    try:
        if hasattr(fmt, "role_chunk"):
            yield with_usage(fmt.role_chunk(request_id, len(requests) * n))
        async for index, output in merged(engine, requests, deadline):
            for completion in output.outputs:
                key = (index, completion.index)
                text_from, tokens_from = sent_text.get(key, 0), sent_tokens.get(key, 0)
                new_text = completion.text[text_from:]
                new_tokens = len(completion.token_ids) - tokens_from
                if not new_text and not completion.finish_reason and not (fmt.wants_logprobs and new_tokens):
                    continue
                sent_text[key], sent_tokens[key] = len(completion.text), len(completion.token_ids)
                chunk = fmt.chunk(request_id, index * n + completion.index, new_text, completion, tokens_from, text_from)
                if chunk is not None:  # a format may hold text back (a tool call's name until complete)
                    yield with_usage(chunk)
            if output.finished:
                finals[index] = output
        if include_usage:
            yield fmt.usage_chunk(request_id, [finals[i] for i in sorted(finals)])
    except (EngineDeadError, RequestFailedError) as error:
        code = 503 if isinstance(error, EngineDeadError) else 500
        yield {"error": {"message": str(error), "type": ERROR_TYPES[code], "param": None, "code": code}}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
