"""The life of an OpenAI request, shared by completions and chat: check the model is served, map the
body onto SamplingParams, prepare every prompt before any is submitted (all or nothing), then run
them and answer whole or as an SSE stream. A client that hangs up cancels its requests.

Admission counts every sequence a body would add (prompts x n) against the waiting queue before any
work, and again when they are handed to the engine; before that, the prompt text and the per-token
lists are bounded (request_limits.py). Tokenization runs on the server's tokenizer threads, never on
the event loop, so a long prompt stalls neither other streams nor /health. Any error after admission
aborts what was admitted.
"""
from __future__ import annotations

import asyncio
import copy
import secrets
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ...core.errors import EngineDeadError, QueueFullError, RequestFailedError
from ...core.outputs import RequestOutput
from ..request_budget import budget_deadline, merged
from ..request_limits import chat_text, check_prompt_chars, check_sampling_lists
from .errors import RETRY_AFTER_SECONDS, APIError, engine_unavailable, param_of
from .protocol import SamplingFields
from .server_state import ServerState
from .streaming import stream_chunks, stream_sse


def check_serving(state: ServerState, body: SamplingFields) -> int:
    """The adapter id the request runs (0: the base model); 404 for a model this server does not serve."""
    if state.draining:
        raise APIError(503, "draining: this server is shutting down; retry on another replica")
    lora_id = state.lora_id_of(body.model)
    if lora_id is None:
        raise APIError(404, f"The model `{body.model}` does not exist.", "model")
    return lora_id


def to_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None, vocab_size: int | None = None):
    """SamplingParams of the body, its per-token lists bounded (request_limits) when `vocab_size` is given."""
    try:
        params = body.sampling_params(max_tokens, logprobs)
        if vocab_size is not None:
            check_sampling_lists(params, vocab_size)
        return params
    except ValueError as error:
        raise APIError(400, str(error), param_of(str(error))) from error


def check_prompt_size(state: ServerState, body: SamplingFields) -> None:
    """The character bound on the prompt text, before any of it is tokenized or rendered."""
    messages = getattr(body, "messages", None)
    texts = [chat_text(messages)] if messages is not None else [p for p in getattr(body, "prompts", list)()
                                                                  if isinstance(p, str)]
    field = "messages" if messages is not None else "prompt"
    try:
        check_prompt_chars(texts, state.prompt_char_limit, field)
    except ValueError as error:
        raise APIError(400, str(error), field) from error


# More prompts than this in one body is a client bug or an attack, not a batch: OpenAI caps its own
# batch inputs at 2048.
MAX_PROMPTS_PER_REQUEST = 2048


def check_capacity(state: ServerState, num_sequences: int) -> None:
    try:
        state.async_engine.check_capacity(num_sequences)
    except QueueFullError as error:
        raise APIError(429, str(error), headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from error
    except EngineDeadError as error:
        raise engine_unavailable(error) from error


async def prepare_all(state: ServerState, body: SamplingFields, prompts: list | Callable[[], list], params, prefix: str,
                      lora_id: int = 0):
    """Validate every prompt of the request before any of them is submitted, then admit them all or none.
    `prompts` may be a function that makes them (a chat template): it runs on a tokenizer thread too."""
    count = len(prompts) if isinstance(prompts, list) else 1
    if count > MAX_PROMPTS_PER_REQUEST:
        raise APIError(400, f"prompt: at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {count}", "prompt")
    check_prompt_size(state, body)
    try:
        check_sampling_lists(params, state.engine.spec.vocab_size)
    except ValueError as error:
        raise APIError(400, str(error), param_of(str(error))) from error
    check_capacity(state, count * params.n)
    engine = state.async_engine
    base_id = f"{prefix}-{secrets.token_hex(12)}"

    def prepare() -> list:
        prepared = []
        for i, prompt in enumerate(prompts if isinstance(prompts, list) else prompts()):
            try:
                prepared.append(engine.prepare(f"{base_id}-{i}", prompt, copy.copy(params), priority=body.priority,
                                               lora_id=lora_id))
            except ValueError as error:
                raise APIError(400, str(error), param_of(str(error)) or "prompt") from error
        return prepared

    requests = await state.off_loop(prepare)
    try:
        slots = engine.admit(requests)
    except QueueFullError as error:
        raise APIError(429, str(error), headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from error
    except EngineDeadError as error:
        raise engine_unavailable(error) from error
    return base_id, list(zip(requests, slots))


async def respond(state: ServerState, http_request: Request, body: SamplingFields, prepared, fmt):
    """The answer to admitted requests; any error on the way aborts them (they must not run unread)."""
    try:
        return await _respond(state, http_request, body, prepared, fmt)
    except BaseException:
        for request, _ in prepared[1]:
            state.async_engine.abort(request.request_id)
        raise


async def _respond(state: ServerState, http_request: Request, body: SamplingFields, prepared, fmt):
    request_id, requests = prepared
    deadline = budget_deadline(http_request.headers, asyncio.get_running_loop().time())
    if body.stream:
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = bool(options and options.continuous_usage_stats)
        chunks = stream_chunks(state.async_engine, requests, fmt, request_id, body.n, include_usage, deadline,
                               continuous_usage)
        # A format may stream events of its own (the Responses API's) instead of the chunks as they are.
        events = fmt.events(request_id, chunks) if hasattr(fmt, "events") else stream_sse(chunks)
        return StreamingResponse(events, media_type="text/event-stream")
    final: dict[int, RequestOutput] = {}

    async def collect() -> None:
        async for index, output in merged(state.async_engine, requests, deadline):
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
        raise engine_unavailable(error) from error
    except RequestFailedError as error:
        raise APIError(500, str(error)) from error
    outputs = [final[i] for i in range(len(requests))]
    return fmt.full_response(request_id, outputs, body.n)
