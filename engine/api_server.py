"""The OpenAI-compatible HTTP API of an engine pod (FastAPI): completions and chat completions,
streamed as SSE or not, plus /v1/models, /health, /version and /metrics.

Every request is validated and tokenized before it reaches the engine; errors use OpenAI's shape.
A client that goes away mid-request cancels it, which aborts it in the engine and frees its blocks.
`model` names the base model or one of the loaded LoRA adapters (see lora_routes.py).
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import __version__
from .async_engine import AsyncEngine, EngineDeadError, QueueFullError
from .lora_routes import add_lora_routes
from .metrics import EngineMetrics
from .outputs import RequestOutput
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

RETRY_AFTER_SECONDS = 1
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}
# SamplingParams / engine messages start with the field they are about.
KNOWN_PARAMS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                "presence_penalty", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs", "prompt",
                "messages")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"), "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


@dataclass
class ServerState:
    async_engine: AsyncEngine
    served_model_name: str
    model_path: str
    api_key: str | None = None
    lora_dirs: list[str] = field(default_factory=list)  # where /v1/load_lora_adapter may read adapters
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: EngineMetrics | None = None

    def __post_init__(self) -> None:
        self.metrics = self.metrics or EngineMetrics(self.async_engine, self.served_model_name)
        lora = self.engine.lora
        taken = [*lora.registered, *lora.retiring] if lora else []
        self._lora_ids = itertools.count(max(taken, default=0) + 1)

    def authorized(self, authorization: str) -> bool:
        """Whether an `Authorization` value (HTTP header or gRPC metadata) carries the API key, if one is set."""
        return not self.api_key or secrets.compare_digest(authorization.encode(), f"Bearer {self.api_key}".encode())

    def lora_id_of(self, model: str) -> int | None:
        """The adapter id a `model` name runs (0: the base model); None when this server does not serve it."""
        if model == self.served_model_name:
            return 0
        adapter = self.engine.lora.find(model) if self.engine.lora else None
        return adapter.lora_int_id if adapter else None

    def new_lora_id(self) -> int:
        """A fresh lora_int_id for an adapter loaded while serving (route or placement)."""
        return next(self._lora_ids)

    @property
    def engine(self):
        return self.async_engine.engine


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kubeinfer engine", version=__version__,
                  description="OpenAI-compatible API of one kubeinfer engine pod")
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError):
        return error_response(error.status, error.message, error.param, error.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(location) or None
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('msg', '')}")
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        return error_response(400, f"{param}: {message}" if param else message, param)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if request.url.path.startswith("/v1") and not state.authorized(request.headers.get("authorization", "")):
            return error_response(401, "invalid or missing API key (send 'Authorization: Bearer KEY')")
        return await call_next(request)

    @app.get("/health")
    async def health():
        if state.draining:
            return error_response(503, "draining: this server is shutting down")
        if not state.async_engine.is_running:
            return error_response(503, "the engine is not running")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        def card(name: str, root: str, parent: str | None) -> dict:
            return {"id": name, "object": "model", "created": state.created, "owned_by": "kubeinfer", "root": root,
                    "parent": parent, "max_model_len": state.engine.max_model_len}

        adapters = [card(r.lora_name, r.lora_path, state.served_model_name) for r in state.engine.list_loras()]
        return {"object": "list", "data": [card(state.served_model_name, state.model_path, None), *adapters]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        lora_id = check_serving(state, body)
        params = to_params(body, body.max_tokens, body.logprobs)
        prepared = prepare_all(state, body, [p if isinstance(p, str) else {"prompt_token_ids": p} for p in body.prompts()],
                               params, "cmpl", lora_id)
        fmt = CompletionFormat(body.model, body.logprobs, body.return_token_ids)
        return await respond(state, request, body, prepared, fmt)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        lora_id = check_serving(state, body)
        prompt_ids = chat_prompt(state, body)
        params = to_params(body, body.effective_max_tokens(), body.logprobs_count())
        prepared = prepare_all(state, body, [{"prompt_token_ids": prompt_ids}], params, "chatcmpl", lora_id)
        return await respond(state, request, body, prepared, ChatFormat(body.model, body.logprobs, body.top_logprobs or 0))

    add_lora_routes(app, state)
    return app


# -- request preparation --------------------------------------------------------------------------
def check_serving(state: ServerState, body: SamplingFields) -> int:
    """The adapter id the request runs (0: the base model); 404 for a model this server does not serve."""
    if state.draining:
        raise APIError(503, "draining: this server is shutting down; retry on another replica")
    lora_id = state.lora_id_of(body.model)
    if lora_id is None:
        raise APIError(404, f"The model `{body.model}` does not exist.", "model")
    return lora_id


def param_of(message: str) -> str | None:
    word = message.split(" ", 1)[0].rstrip(":")
    return word if word in KNOWN_PARAMS else None


def to_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None):
    try:
        return body.sampling_params(max_tokens, logprobs)
    except ValueError as error:
        raise APIError(400, str(error), param_of(str(error))) from error


def chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    tokenizer = state.engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                             tokenize=False, **(body.chat_template_kwargs or {}))
    except ValueError as error:
        raise APIError(400, str(error), "messages") from error
    except Exception as error:  # a template error is the request's fault (bad roles, order...)
        raise APIError(400, f"messages: the chat template failed: {error}", "messages") from error
    # The template writes the special tokens itself; adding them again would double the BOS.
    return tokenizer.encode(text, add_special_tokens=False)


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


async def merged(engine: AsyncEngine, requests) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, request) -> None:
        try:
            async for output in engine.stream(request):
                await queue.put((index, output))
        except BaseException as error:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((index, error))
            return
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # a cancelled pump leaves engine.stream, which aborts its request


async def respond(state: ServerState, http_request: Request, body: SamplingFields, prepared, fmt):
    request_id, requests = prepared
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream_sse(state, requests, fmt, request_id, body.n, include_usage),
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


async def stream_sse(state: ServerState, requests, fmt, request_id: str, n: int, include_usage: bool):
    sent_text: dict[tuple[int, int], int] = {}
    sent_tokens: dict[tuple[int, int], int] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        if hasattr(fmt, "role_chunk"):
            yield sse(fmt.role_chunk(request_id, len(requests) * n))
        async for index, output in merged(state.async_engine, requests):
            for completion in output.outputs:
                key = (index, completion.index)
                text_from, tokens_from = sent_text.get(key, 0), sent_tokens.get(key, 0)
                new_text = completion.text[text_from:]
                new_tokens = len(completion.token_ids) - tokens_from
                if not new_text and not completion.finish_reason and not (fmt.wants_logprobs and new_tokens):
                    continue
                sent_text[key], sent_tokens[key] = len(completion.text), len(completion.token_ids)
                yield sse(fmt.chunk(request_id, index * n + completion.index, new_text, completion, tokens_from, text_from))
            if output.finished:
                finals[index] = output
        if include_usage:
            yield sse(fmt.usage_chunk(request_id, [finals[i] for i in sorted(finals)]))
    except EngineDeadError as error:
        yield sse({"error": {"message": str(error), "type": ERROR_TYPES[500], "param": None, "code": 500}})
    yield "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# -- response shapes --------------------------------------------------------------------------------
def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass
class CompletionFormat:
    model: str
    logprobs: int | None
    return_token_ids: bool = False  # vLLM's extension: the prompt's and the completion's token ids

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def _logprobs(self, completion, token_from: int, text_offset: int) -> dict | None:
        if self.logprobs is None or completion.logprobs is None:
            return None
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = text_offset
        for token, entry in zip(completion.token_ids[token_from:], completion.logprobs[token_from:]):
            chosen = entry[token]
            text = chosen.decoded_token or ""
            result["tokens"].append(text)
            result["token_logprobs"].append(chosen.logprob)
            result["top_logprobs"].append({lp.decoded_token or "": lp.logprob for lp in entry.values()})
            result["text_offset"].append(offset)
            offset += len(text)
        return result

    def choice(self, index: int, text: str, completion, token_from: int = 0, text_offset: int = 0,
               prompt_token_ids: list[int] | None = None) -> dict:
        choice = {"index": index, "text": text, "logprobs": self._logprobs(completion, token_from, text_offset),
                  "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
        if self.return_token_ids:
            choice["token_ids"] = completion.token_ids[token_from:]
            choice["prompt_token_ids"] = prompt_token_ids if token_from == 0 else None
        return choice

    def full_response(self, request_id: str, outputs: list[RequestOutput], n: int) -> dict:
        choices = [self.choice(i * n + c.index, c.text, c, prompt_token_ids=o.prompt_token_ids)
                   for i, o in enumerate(outputs) for c in o.outputs]
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": choices, "usage": usage(outputs)}

    def chunk(self, request_id, index, text, completion, token_from, text_from) -> dict:
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": [self.choice(index, text, completion, token_from, text_from)]}

    def usage_chunk(self, request_id, outputs) -> dict:
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": [], "usage": usage(outputs)}


@dataclass
class ChatFormat:
    model: str
    logprobs: bool
    top_logprobs: int = 0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    def _logprobs(self, completion, token_from: int) -> dict | None:
        if not self.logprobs or completion.logprobs is None:
            return None

        def item(text: str | None, logprob: float) -> dict:
            text = text or ""
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for token, entry in zip(completion.token_ids[token_from:], completion.logprobs[token_from:]):
            chosen = entry[token]
            top = [item(lp.decoded_token, lp.logprob) for lp in sorted(entry.values(), key=lambda lp: lp.rank)
                   if lp.rank <= self.top_logprobs]
            content.append({**item(chosen.decoded_token, chosen.logprob), "top_logprobs": top})
        return {"content": content}

    def full_response(self, request_id: str, outputs: list[RequestOutput], n: int) -> dict:
        output = outputs[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c, 0), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in output.outputs]
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": self.model,
                "choices": choices, "usage": usage(outputs)}

    def _chunk(self, request_id: str, choices: list[dict]) -> dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model,
                "choices": choices}

    def role_chunk(self, request_id: str, count: int) -> dict:
        return self._chunk(request_id, [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                         "finish_reason": None} for i in range(count)])

    def chunk(self, request_id, index, text, completion, token_from, text_from) -> dict:
        delta = {"content": text} if text else {}
        return self._chunk(request_id, [{"index": index, "delta": delta, "logprobs": self._logprobs(completion, token_from),
                                         "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}])

    def usage_chunk(self, request_id, outputs) -> dict:
        return {**self._chunk(request_id, []), "usage": usage(outputs)}
