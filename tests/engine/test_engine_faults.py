"""Faults injected into the engine, and what it must say and do about them.

A step that raises ends its batch's requests with the error and the engine serves on; failed steps in
a row, or one device error, kill it: /health turns 503, in-flight requests get 503, and `kubeinfer
serve` exits non-zero. Admission that raises for one sequence ends that sequence alone. After every
fault the block invariant holds: each block's reference count is the number of live sequences that
hold it, and free + used == total.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter

import httpx
import openai
import pytest
from server_harness import RunningServer, free_port

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.core.async_engine import AsyncEngine
from kubeinfer.engine.core.errors import EngineDeadError, RequestFailedError, StepFailedError
from kubeinfer.dev.local_stack import wait_healthy

PROMPT = "The licensee may copy and distribute"


def assert_block_invariant(engine) -> None:
    bm = engine.block_manager
    live = engine.scheduler.running + engine.scheduler.waiting
    assert not any(s.is_finished for s in live)
    held = Counter(block for seq in live for block in seq.block_table)
    assert [b.ref_count for b in bm.blocks] == [held[b.block_id] for b in bm.blocks]
    used = sum(1 for b in bm.blocks if b.ref_count)
    assert bm.num_free_blocks + used == bm.num_blocks
    assert not (set(bm.free_uncached) & set(bm.free_cached))


class FailingSteps:
    """Wraps ModelRunner.execute: raises `error` on the calls numbered in `failing` (1-based)."""

    def __init__(self, runner, failing: set[int], error: Exception) -> None:
        self.execute, self.failing, self.error, self.calls = runner.execute, failing, error, 0
        runner.execute = self

    def __call__(self, batch, *args):
        self.calls += 1
        if self.calls in self.failing:
            raise self.error
        return self.execute(batch, *args)


def run_all(engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except StepFailedError as failure:
            outputs = failure.outputs
        finished.update({o.request_id: o for o in outputs if o.finished})
    return finished


def test_a_step_that_raises_ends_its_batch_and_the_engine_serves_on(llama_dir):
    engine = LLM(llama_dir, block_size=4, max_num_seqs=2).engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    FailingSteps(engine.runner, {2}, RuntimeError("injected"))
    for name in ("a", "b", "c"):  # max_num_seqs=2: "c" waits while a and b run
        engine.add_request(name, PROMPT, params)
    engine.step()
    with pytest.raises(StepFailedError) as failure:
        engine.step()
    ended = {o.request_id: o for o in failure.value.outputs}
    assert set(ended) == {"a", "b"} and all(o.finished for o in ended.values())
    assert all(o.outputs[0].finish_reason == "abort" and "injected" in o.error for o in ended.values())
    assert_block_invariant(engine)
    assert not engine.abort("a")  # gone for good, nothing left behind
    finished = run_all(engine)
    assert finished["c"].error is None and len(finished["c"].outputs[0].token_ids) == 6
    assert_block_invariant(engine) and engine.block_manager.usage == 0


def test_admission_that_raises_ends_that_sequence_alone(lora_base_dir, lora_adapters):
    """An adapter that cannot be pinned (e.g. an OSError re-reading it) used to leak the blocks taken for
    its sequence and leave it in neither queue."""
    from kubeinfer.engine import LLMEngine
    from kubeinfer.engine.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=str(lora_base_dir), enable_lora=True, max_loras=2, max_lora_rank=8,
                                    block_size=4))
    engine.add_lora(lora_adapters["attn"][0])
    pool = engine.lora.pool
    acquire = pool.acquire

    def broken_acquire(lora_id):
        raise OSError(f"adapter {lora_id}: Input/output error")

    pool.acquire = broken_acquire
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("adapter", [5, 6, 7, 8, 9, 10, 11, 12, 13], params, lora_id=1)
    engine.add_request("base", [5, 6, 7, 8, 9, 10, 11, 12, 13], params)
    outputs = engine.step()
    failed = next(o for o in outputs if o.request_id == "adapter")
    assert failed.finished and "Input/output error" in failed.error
    assert_block_invariant(engine)
    assert not engine.abort("adapter")
    pool.acquire = acquire
    finished = run_all(engine)
    assert len(finished["base"].outputs[0].token_ids) == 5
    assert engine.block_manager.usage == 0 and pool.pinned_names() == []


def test_consecutive_failed_steps_kill_the_engine_and_health_says_so(llama_dir):
    with RunningServer(llama_dir, block_size=8) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
        steps = FailingSteps(server.engine.runner, {1}, RuntimeError("transient"))
        with pytest.raises(openai.InternalServerError, match="transient"):
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        assert httpx.get(server.url + "/health").status_code == 200  # one failure: still serving
        ok = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
        assert ok.usage.completion_tokens == 4

        steps.failing = set(range(steps.calls + 1, steps.calls + 100))
        for _ in range(server.async_engine.max_consecutive_failures):
            with pytest.raises(openai.APIStatusError):
                client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        assert server.wait_for(lambda: server.async_engine.death is not None)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "failed in a row" in health.json()["error"]["message"]
        refused = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert server.metric("vllm:num_requests_running") == 0


def test_a_device_error_kills_the_engine_at_once_and_fails_what_is_in_flight(llama_dir):
    from kubeinfer.engine.config import EngineConfig
    from kubeinfer.engine.core.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=llama_dir, block_size=8))
    async_engine = AsyncEngine(engine)
    deaths = []
    async_engine.on_death.append(deaths.append)
    FailingSteps(engine.runner, {3}, RuntimeError("CUDA error: an illegal memory access was encountered"))

    async def main():
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        first = await asyncio.to_thread(async_engine.prepare, "first", PROMPT, params)
        late = await asyncio.to_thread(async_engine.prepare, "late", PROMPT, params)
        errors = []
        slot = async_engine.admit([first])[0]
        async_engine.start()
        try:
            async for _ in async_engine.stream(first, slot):
                pass
        except (EngineDeadError, RequestFailedError) as error:
            errors.append(error)
        with pytest.raises(EngineDeadError):
            async_engine.admit([late])
        return errors

    errors = asyncio.run(main())
    async_engine.shutdown()
    assert errors and "illegal memory access" in str(errors[0])
    assert deaths and "unrecoverable device error" in deaths[0] and not async_engine.healthy


def test_serve_exits_non_zero_when_the_engine_dies(llama_dir, tmp_path):
    """The process a pod runs: after the engine dies it must end with a failure code, so that Kubernetes
    restarts the container instead of keeping a pod that answers every request with an error."""
    launcher = tmp_path / "faulty_serve.py"
    launcher.write_text(textwrap.dedent("""
        import sys
        from kubeinfer.engine.model_executor.model_runner import ModelRunner

        def execute(self, batch):
            raise RuntimeError("CUDA error: device-side assert triggered")

        ModelRunner.execute = execute
        from kubeinfer.cli import main
        sys.exit(main())
    """))
    port, grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, str(launcher), "serve", llama_dir, "--host", "127.0.0.1", "--port",
                                str(port), "--served-model-name", "tiny", "--grpc-port", str(grpc_port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert wait_healthy(url, process, time.monotonic() + 60), "server never became healthy"
        response = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3},
                              timeout=30)
        assert response.status_code == 503 and "device-side assert" in response.json()["error"]["message"]
        assert process.wait(timeout=30) == 1
        assert b"the engine died" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()


def test_admission_counts_every_sequence_of_a_body(llama_dir):
    with RunningServer(llama_dir, block_size=8, max_waiting_requests=4) as server:
        body = {"model": "tiny", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2}
        refused = httpx.post(server.url + "/v1/completions", json=body)
        assert refused.status_code == 429 and refused.headers["retry-after"]
        assert "adds 6" in refused.json()["error"]["message"]
        assert server.engine.requests == {} and server.async_engine.num_unfinished == 0  # nothing was taken
        ok = httpx.post(server.url + "/v1/completions", json={**body, "prompt": ["a", "b"]}, timeout=60)
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
        too_many = httpx.post(server.url + "/v1/completions", json={**body, "n": 1, "prompt": ["x"] * 3000})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"


def test_a_stalled_reader_holds_only_the_latest_output(llama_dir):
    """The engine runs a whole request while nobody reads: the slot keeps one cumulative output, and the
    reader's first read is the finished one."""
    from kubeinfer.engine.config import EngineConfig
    from kubeinfer.engine.core.llm_engine import LLMEngine

    async_engine = AsyncEngine(LLMEngine(EngineConfig(model=llama_dir, block_size=8)))
    async_engine.start()

    async def main():
        request = async_engine.prepare("slow", PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        slot = async_engine.admit([request])[0]
        while async_engine.num_unfinished:  # the engine finishes while nobody reads
            await asyncio.sleep(0.01)
        outputs = [o async for o in async_engine.stream(request, slot)]
        return slot, outputs

    try:
        slot, outputs = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert len(outputs) == 1 and outputs[0].finished and len(outputs[0].outputs[0].token_ids) == 40
    assert slot._latest is None


def test_tokenization_never_blocks_the_event_loop(llama_dir):
    """A prompt whose tokenization hangs (a huge prompt, a slow chat template) leaves /health answering."""
    with RunningServer(llama_dir, block_size=8) as server:
        tokenizer = server.engine.tokenizer
        encode, release, entered, threads = tokenizer.encode, threading.Event(), threading.Event(), []

        def slow_encode(*args, **kwargs):
            threads.append(threading.current_thread().name)
            entered.set()
            release.wait(30)
            return encode(*args, **kwargs)

        tokenizer.encode = slow_encode
        try:
            result = {}
            request = threading.Thread(target=lambda: result.update(r=httpx.post(
                server.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}, timeout=60)))
            request.start()
            assert entered.wait(30)
            started = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            assert time.monotonic() - started < 5
            release.set()
            request.join(60)
        finally:
            tokenizer.encode = encode
            release.set()
        assert result["r"].status_code == 200
        assert threads and all(name.startswith("tokenizer") for name in threads)
