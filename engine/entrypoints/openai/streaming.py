"""Outputs on their way out, shared by completions and chat: the output streams of a body's prompts
merged into one, Server-Sent Events (one `data:` line per chunk, ending in `data: [DONE]`) and the
`usage` block. A format object (CompletionFormat, ChatFormat) says what each chunk looks like; this
module decides which chunks to send. A request with `x-request-timeout-ms` ends when it is spent.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace

from ...core.async_engine import AsyncEngine
from ...core.errors import EngineDeadError, RequestFailedError
from ...core.outputs import CompletionOutput, RequestOutput
from .errors import ERROR_TYPES

TIMEOUT_HEADER = "x-request-timeout-ms"  # the client's (or the gateway's remaining) time budget
TIMEOUT_FINISH_REASON = "timeout"  # a completion its budget ended; usage counts what it generated


def budget_deadline(headers, loop_time: float) -> float | None:
    """The loop time at which a request's `x-request-timeout-ms` budget ends; None without a valid one
    (an invalid value is ignored: it is read after the request was admitted)."""
    try:
        milliseconds = int(headers.get(TIMEOUT_HEADER, ""))
    except ValueError:
        return None
    return loop_time + milliseconds / 1000.0 if milliseconds > 0 else None


def timed_out(request, latest: RequestOutput | None) -> RequestOutput:
    """A request as it stood when its budget ran out, finished: each unfinished completion with
    finish_reason "timeout", so usage counts what was generated."""
    done = {c.index: c for c in (latest.outputs if latest else [])}
    completions = [replace(done[i], finish_reason=done[i].finish_reason or TIMEOUT_FINISH_REASON) if i in done
                   else CompletionOutput(i, "", [], finish_reason=TIMEOUT_FINISH_REASON)
                   for i in range(request.params.n)]
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, True,
                         latest.num_cached_tokens if latest else 0)


async def merged(engine: AsyncEngine, admitted, deadline: float | None = None
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several admitted (request, slot) pairs as they come, tagged with the request's position.
    The queue is bounded: while the consumer is slow, each request's slot merges its newer outputs.
    At `deadline` (loop time) the unfinished ones end with finish_reason "timeout" and are aborted."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)
    latest: dict[int, RequestOutput] = {}

    async def pump(index: int, request, slot) -> None:
        try:
            async for output in engine.stream(request, slot):
                await queue.put((index, output))
        except BaseException as error:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((index, error))
            return
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, r, slot)) for i, (r, slot) in enumerate(admitted)]
    try:
        remaining = len(tasks)
        while remaining:
            try:
                async with asyncio.timeout_at(deadline):
                    index, item = await queue.get()
            except TimeoutError:
                for index, (request, _) in enumerate(admitted):
                    if not (index in latest and latest[index].finished):
                        yield index, timed_out(request, latest.get(index))
                return
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                latest[index] = item
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # a cancelled pump leaves engine.stream, which aborts its request


async def stream_sse(engine: AsyncEngine, requests, fmt, request_id: str, n: int, include_usage: bool,
                     deadline: float | None = None):
    sent_text: dict[tuple[int, int], int] = {}
    sent_tokens: dict[tuple[int, int], int] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        if hasattr(fmt, "role_chunk"):
            yield sse(fmt.role_chunk(request_id, len(requests) * n))
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
                    yield sse(chunk)
            if output.finished:
                finals[index] = output
        if include_usage:
            yield sse(fmt.usage_chunk(request_id, [finals[i] for i in sorted(finals)]))
    except (EngineDeadError, RequestFailedError) as error:
        code = 503 if isinstance(error, EngineDeadError) else 500
        yield sse({"error": {"message": str(error), "type": ERROR_TYPES[code], "param": None, "code": code}})
    yield "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
