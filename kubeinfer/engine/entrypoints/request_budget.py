"""Requests run to a time budget: the outputs of a body's admitted requests merged into one stream,
ended at the budget's deadline with finish_reason "timeout" (usage still counts what was generated).
The budget is `x-request-timeout-ms` (the client's, or what the gateway forwards as left of it) and,
on gRPC, the call's own deadline. Shared by the OpenAI routes and the gRPC API.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from ..core.async_engine import AsyncEngine
from ..core.outputs import CompletionOutput, RequestOutput

TIMEOUT_HEADER = "x-request-timeout-ms"  # the client's (or the gateway's remaining) time budget
TIMEOUT_FINISH_REASON = "timeout"  # a completion its budget ended; usage counts what it generated
MAX_TIMEOUT_MS = 24 * 3600 * 1000  # a day: longer budgets mean nothing to a serving engine


def budget_deadline(headers, loop_time: float) -> float | None:
    """The loop time at which a request's `x-request-timeout-ms` budget ends; None without a valid one
    (the front ends refuse an invalid one before admission: request_limits.check_timeout_header; here
    one is ignored, and a huge one is held to MAX_TIMEOUT_MS, so nothing raises after admission)."""
    try:
        milliseconds = min(int(headers.get(TIMEOUT_HEADER, "")), MAX_TIMEOUT_MS)
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
