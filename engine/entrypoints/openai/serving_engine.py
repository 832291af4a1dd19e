"""The life of an OpenAI request, shared by completions and chat: check the model is served, map the
body onto SamplingParams, prepare every prompt before any is submitted (all or nothing), then run
them and answer whole or as an SSE stream. A client that hangs up cancels its requests."""
from __future__ import annotations

import asyncio
import copy
import secrets

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ...core.async_engine import EngineDeadError, QueueFullError
from ...core.outputs import RequestOutput
from .errors import RETRY_AFTER_SECONDS, APIError, param_of
from .protocol import SamplingFields
from .server_state import ServerState
from .streaming import merged, stream_sse


def check_serving(state: ServerState, body: SamplingFields) -> int:
    """The adapter id the request runs (0: the base model); 404 for a model this server does not serve."""
    if state.draining:
        raise APIError(503, "draining: this server is shutting down; retry on another replica")
    lora_id = state.lora_id_of(body.model)
    if lora_id is None:
        raise APIError(404, f"The model `{body.model}` does not exist.", "model")
    return lora_id


def to_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None):
    try:
        return body.sampling_params(max_tokens, logprobs)
    except ValueError as error:
        raise APIError(400, str(error), param_of(str(error))) from error


def prepare_all(state: ServerState, body: SamplingFields, prompts: list, params, prefix: str, lora_id: int = 0):
    """Validate every prompt of the request before any of them is submitted: all or nothing."""
    engine = state.async_engine
    base_id = f"{prefix}-{secrets.token_hex(12)}"
    prepared = []
    for i, prompt in enumerate(prompts):
        try:
            prepared.append(engine.prepare(f"{base_id}-{i}", prompt, copy.copy(params), priority=body.priority,
                                           lora_id=lora_id))
        except QueueFullError as error:
            raise APIError(429, str(error), headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from error
        except ValueError as error:
            raise APIError(400, str(error), param_of(str(error)) or "prompt") from error
    return base_id, prepared


async def respond(state: ServerState, http_request: Request, body: SamplingFields, prepared, fmt):
    request_id, requests = prepared
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream_sse(state.async_engine, requests, fmt, request_id, body.n, include_usage),
                                 media_type="text/event-stream")
    final: dict[int, RequestOutput] = {}

    async def collect() -> None:
        async for index, output in merged(state.async_engine, requests):
            if output.finished:
                final[index] = output

    task = asyncio.create_task(collect())
    while not task.done():  # a client that hangs up cancels its request
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await http_request.is_disconnected():
            task.cancel()
            return Response(status_code=499)
    try:
        task.result()
    except EngineDeadError as error:
        raise APIError(500, str(error)) from error
    outputs = [final[i] for i in range(len(requests))]
    return fmt.full_response(request_id, outputs, body.n)
