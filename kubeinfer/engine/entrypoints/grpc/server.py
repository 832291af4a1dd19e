"""The engine's gRPC API (kubeinfer/engine/entrypoints/grpc/proto/engine.proto): a server-streaming `Generate`,
`ListModels`, and the standard gRPC health service, served beside the HTTP API from the same engine loop.

Requests are validated exactly as over HTTP (the same SamplingParams checks, before any model work);
errors map to gRPC status codes: INVALID_ARGUMENT, NOT_FOUND (unknown model), UNAUTHENTICATED,
RESOURCE_EXHAUSTED (waiting queue full), UNAVAILABLE (draining). A cancelled call aborts its request.
A call's time budget is its gRPC deadline or its `x-request-timeout-ms` metadata, whichever ends first:
when it is spent the request ends with finish_reason "timeout" and its usage, a margin before the
deadline so that the last message arrives (request_budget.py, as over HTTP).
"""
from __future__ import annotations

import asyncio
import itertools
import secrets

import grpc

from kubeinfer.common.grpc_health import HealthCheckedServer

from ...core.errors import EngineDeadError, QueueFullError, RequestFailedError
from ...sampling_params import SamplingParams
from ..request_budget import budget_deadline, merged
from ..request_limits import check_prompt_chars, check_sampling_lists, check_timeout_header
from .proto import engine_pb2, engine_pb2_grpc

SERVICE_NAME = "kubeinfer.engine.v1.Engine"
DEADLINE_MARGIN_SECONDS = 0.05  # the final message leaves this long before the call's deadline
_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                      "presence_penalty", "seed", "max_tokens", "logprobs")


def sampling_params(message: engine_pb2.SamplingParams) -> SamplingParams:
    """The request's SamplingParams: unset optional fields keep the offline API's defaults."""
    kwargs = {name: getattr(message, name) for name in _OPTIONAL_SAMPLING if message.HasField(name)}
    kwargs.setdefault("max_tokens", 16)
    return SamplingParams(stop=list(message.stop) or None, stop_token_ids=list(message.stop_token_ids) or None,
                          ignore_eos=message.ignore_eos, min_tokens=message.min_tokens,
                          include_stop_str_in_output=message.include_stop_str_in_output, **kwargs)


def call_deadline(metadata, time_remaining: float | None, loop_time: float) -> float | None:
    """The loop time at which the call's budget ends: its `x-request-timeout-ms` metadata or its own
    deadline less the margin, whichever is sooner; None without either."""
    budget = budget_deadline(metadata, loop_time)
    if time_remaining is not None:
        own = loop_time + max(0.0, time_remaining - DEADLINE_MARGIN_SECONDS)
        budget = own if budget is None else min(budget, own)
    return budget


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(self, state) -> None:
        self.state = state
        self._ids = itertools.count()

    async def _check_access(self, context: grpc.aio.ServicerContext) -> None:
        state = self.state
        if not state.authorized(dict(context.invocation_metadata()).get("authorization", "")):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key "
                                "(send metadata 'authorization: Bearer KEY')")
        if state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining: this server is shutting down")

    async def _lora_id(self, model: str, context) -> int:
        lora_id = self.state.lora_id_of(model) if model else 0  # empty: the base model
        if lora_id is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"The model `{model}` does not exist.")
        return lora_id

    async def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        await self._check_access(context)
        lora_id = await self._lora_id(request.model, context)
        which = request.WhichOneof("prompt")
        if which is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: set text or token_ids")
        prompt = request.text if which == "text" else {"prompt_token_ids": list(request.token_ids.ids)}
        engine = self.state.async_engine
        request_id = f"grpc-{next(self._ids)}-{secrets.token_hex(6)}"
        metadata = dict(context.invocation_metadata())
        try:
            check_timeout_header(metadata)  # before admission: nothing may raise about it after
            params = sampling_params(request.sampling)
            check_sampling_lists(params, self.state.engine.spec.vocab_size)
            if which == "text":
                check_prompt_chars([request.text], self.state.prompt_char_limit)
            engine.check_capacity(params.n)
            prepared = await self.state.off_loop(
                lambda: engine.prepare(request_id, prompt, params, priority=request.priority, lora_id=lora_id))
            slot = engine.admit([prepared])[0]
        except QueueFullError as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except EngineDeadError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

        sent_tokens = sent_text = 0
        try:
            deadline = call_deadline(metadata, context.time_remaining(), asyncio.get_running_loop().time())
            async for _, output in merged(engine, [(prepared, slot)], deadline):
                completion = output.outputs[0]
                response = engine_pb2.GenerateResponse(request_id=output.request_id,
                                                       token_ids=completion.token_ids[sent_tokens:],
                                                       text=completion.text[sent_text:])
                if completion.logprobs is not None:
                    response.logprobs.extend(entry[token].logprob for token, entry in
                                             zip(completion.token_ids[sent_tokens:], completion.logprobs[sent_tokens:]))
                sent_tokens, sent_text = len(completion.token_ids), len(completion.text)
                if output.finished:
                    response.finish_reason = completion.finish_reason or "abort"
                    response.usage.CopyFrom(engine_pb2.Usage(prompt_tokens=len(output.prompt_token_ids),
                                                             completion_tokens=len(completion.token_ids),
                                                             cached_prompt_tokens=output.num_cached_tokens))
                yield response
        except EngineDeadError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except RequestFailedError as error:
            await context.abort(grpc.StatusCode.INTERNAL, str(error))
        finally:  # whatever ended the call (an error, a cancel), the admitted request ends with it
            engine.abort(prepared.request_id)

    async def ListModels(self, request, context):
        await self._check_access(context)
        state = self.state
        models = [engine_pb2.Model(id=state.served_model_name)]
        models += [engine_pb2.Model(id=r.lora_name, parent=state.served_model_name) for r in state.engine.list_loras()]
        return engine_pb2.ListModelsResponse(models=models)


async def start_grpc_server(state, host: str, port: int) -> HealthCheckedServer:
    """Serve the Engine and Health services on host:port (port 0 picks a free one: see .port)."""
    return await HealthCheckedServer.start(
        lambda server: engine_pb2_grpc.add_EngineServicer_to_server(EngineService(state), server),
        SERVICE_NAME, host, port)
