"""The gRPC API, driven by the client generated from kubeinfer/engine/entrypoints/grpc/proto/engine.proto, against a
real server."""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_harness import RunningServer

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.entrypoints.grpc.server import SERVICE_NAME, start_grpc_server
from kubeinfer.engine.entrypoints.grpc.proto import engine_pb2, engine_pb2_grpc

PROMPT = "The licensee may copy and distribute"


class GrpcThread:
    """The gRPC server of a RunningServer's state, on its own event loop thread."""

    def __init__(self, state) -> None:
        self.state = state
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(start_grpc_server(self.state, "127.0.0.1", 0), self.loop).result(30)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        return self

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def __exit__(self, *exc) -> None:
        self.channel.close()
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(llama_dir):
    with RunningServer(llama_dir, name="tiny", block_size=8) as running, GrpcThread(running.state) as grpc_server:
        running.grpc = grpc_server
        yield running


@pytest.fixture(scope="module")
def stub(server):
    return engine_pb2_grpc.EngineStub(server.grpc.channel)


def greedy(max_tokens: int, **extra) -> engine_pb2.SamplingParams:
    return engine_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def test_generate_streams_what_the_offline_engine_generates(stub, llama_dir):
    offline = LLM(llama_dir, block_size=8).generate(PROMPT, SamplingParams(temperature=0, max_tokens=12,
                                                                           ignore_eos=True, logprobs=0))[0]
    messages = list(stub.Generate(engine_pb2.GenerateRequest(model="tiny", text=PROMPT, sampling=greedy(12, logprobs=0))))
    assert len(messages) > 1  # streamed, not one final message
    assert [t for m in messages for t in m.token_ids] == offline.outputs[0].token_ids
    assert "".join(m.text for m in messages) == offline.outputs[0].text
    logprobs = [lp for m in messages for lp in m.logprobs]
    want = [entry[t].logprob for t, entry in zip(offline.outputs[0].token_ids, offline.outputs[0].logprobs)]
    assert logprobs == pytest.approx(want, abs=1e-4)
    assert [m.finish_reason for m in messages[:-1]] == [""] * (len(messages) - 1)
    last = messages[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == len(offline.prompt_token_ids)
    # Token ids in, and the base model by default (empty model name).
    ids = list(stub.Generate(engine_pb2.GenerateRequest(token_ids=engine_pb2.TokenIds(ids=offline.prompt_token_ids),
                                                        sampling=greedy(12))))
    assert [t for m in ids for t in m.token_ids] == offline.outputs[0].token_ids


@pytest.mark.parametrize("request_kwargs, code, message", [
    (dict(model="nope", text=PROMPT), grpc.StatusCode.NOT_FOUND, "does not exist"),
    (dict(text=PROMPT, sampling=engine_pb2.SamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT,
     "temperature"),
    (dict(text=PROMPT, sampling=engine_pb2.SamplingParams(max_tokens=100000)), grpc.StatusCode.INVALID_ARGUMENT,
     "max_tokens"),
    (dict(token_ids=engine_pb2.TokenIds(ids=[10**6])), grpc.StatusCode.INVALID_ARGUMENT, "token ids"),
    (dict(model="tiny"), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(text=""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
], ids=["unknown-model", "temperature", "max-tokens-over-context", "token-out-of-vocab", "no-prompt", "empty-prompt"])
def test_invalid_requests(stub, request_kwargs, code, message):
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(engine_pb2.GenerateRequest(**request_kwargs)))
    assert error.value.code() == code and message in error.value.details()


def test_cancelling_the_call_frees_the_request(stub, server):
    call = stub.Generate(engine_pb2.GenerateRequest(text=PROMPT, sampling=greedy(400)))
    next(call)
    assert server.engine.block_manager.usage > 0
    call.cancel()
    assert server.wait_for(lambda: server.engine.num_running == 0 and server.engine.block_manager.usage == 0)


@pytest.mark.parametrize("budget", [{"timeout": 0.1}, {"metadata": [("x-request-timeout-ms", "50")]}])
def test_a_call_out_of_time_ends_with_finish_reason_timeout_and_its_usage(stub, server, budget):
    """The call's gRPC deadline (less a margin for the last message), or its x-request-timeout-ms: the
    stream ends in time with what was generated, not with DEADLINE_EXCEEDED, and the blocks are freed."""
    max_tokens = 480  # the whole context: far more than 50 ms of decoding
    responses = list(stub.Generate(engine_pb2.GenerateRequest(text=PROMPT, sampling=greedy(max_tokens)), **budget))
    last = responses[-1]
    assert last.finish_reason == "timeout"
    generated = sum(len(r.token_ids) for r in responses)
    assert generated < max_tokens and last.usage.completion_tokens == generated
    assert server.wait_for(lambda: server.engine.num_running == 0 and server.engine.block_manager.usage == 0)


def test_health_and_models(server, stub):
    health = health_pb2_grpc.HealthStub(server.grpc.channel)
    for service in ("", SERVICE_NAME):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    assert [(m.id, m.parent) for m in stub.ListModels(engine_pb2.ListModelsRequest()).models] == [("tiny", "")]


def test_api_key_and_draining(llama_dir):
    with RunningServer(llama_dir, name="tiny", api_key="sekret") as running, GrpcThread(running.state) as server:
        stub = engine_pb2_grpc.EngineStub(server.channel)
        request = engine_pb2.GenerateRequest(text=PROMPT, sampling=greedy(2))
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(request))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert list(stub.Generate(request, metadata=[("authorization", "Bearer sekret")]))[-1].finish_reason == "length"
        running.state.draining = True
        server.run(server.server.start_draining())
        health = health_pb2_grpc.HealthStub(server.channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(request, metadata=[("authorization", "Bearer sekret")]))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_generated_stubs_match_the_proto(tmp_path):
    """engine_pb2*.py are committed; regenerating them from engine.proto must change nothing (`make proto`)."""
    from pathlib import Path

    from kubeinfer.engine.entrypoints.grpc.proto import generate

    for path in generate.generate(tmp_path):
        committed = Path(generate.__file__).parent / path.name
        assert _without_version_stamp(path) == _without_version_stamp(committed), f"{path.name} is stale: run `make proto`"


def _without_version_stamp(path) -> list[str]:
    """The stub's lines less GRPC_GENERATED_VERSION: grpcio-tools stamps its own release there (1.85.1 wrote the
    committed stubs, a later 1.85.x the same code), and the stamp is only the oldest grpcio the stubs accept."""
    return [line for line in path.read_text().splitlines() if not line.startswith("GRPC_GENERATED_VERSION = ")]
