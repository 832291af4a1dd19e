"""Deferred text (async output processing): a step's detokenizing and output building run inside the
next step, after it is launched. On a GPU that is while the device computes; here on the CPU the forward
is synchronous, so these tests switch it on to check what must not change: every output, every fault
path, and the order (the text of step N after the launch of step N+1)."""
from __future__ import annotations

import asyncio

import pytest
import torch
from test_engine_faults import FailingSteps, assert_block_invariant, run_all

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.core.async_engine import AsyncEngine
from kubeinfer.engine.core.errors import StepFailedError

PROMPTS = ["The licensee may copy and distribute", "Once upon a time", "def main():", "In the beginning"]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def engine_pair(llama_dir, **kwargs):
    return (LLM(llama_dir, block_size=4, async_output_processing=False, **kwargs),
            LLM(llama_dir, block_size=4, async_output_processing=True, **kwargs))


class Near(float):
    """A log-prob equal to another within 1e-4: the inline engine's probe leaves PROMPTS[0] in its prefix cache, so
    that prefill runs in other shapes there and its sums differ in the last float bits (seen at 1e-6 through torch's
    ops, 2.6e-6 with the native CPU ops): rounding both to 5 places failed whenever a value straddled the rounding."""

    def __eq__(self, other):
        return abs(float(self) - float(other)) < 1e-4

    __hash__ = float.__hash__


def summary(outputs) -> list:
    return [[(c.text, c.token_ids, c.finish_reason, c.stop_reason,
              None if c.cumulative_logprob is None else Near(c.cumulative_logprob),
              None if c.logprobs is None else [{t: (Near(lp.logprob), lp.rank, lp.decoded_token)
                                                 for t, lp in entry.items()} for entry in c.logprobs])
             for c in o.outputs] for o in outputs]


def request_mix(stop_text: str) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=12),
            SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=10, n=2),
            SamplingParams(temperature=0, max_tokens=9, logprobs=2, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=12, stop=[stop_text], ignore_eos=True),  # text decides its end
            SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[7, 11, 13], min_tokens=2, ignore_eos=True)]


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_min": 1}])
@pytest.mark.parametrize("mix", ["all", "sync-free"])
def test_outputs_are_the_same_with_and_without_deferred_text(llama_dir, speculative, mix):
    """"all": while the logprobs request runs, its steps need the ids on the host and keep their text; "sync-free"
    (greedy and sampled rows, stop strings and stop tokens) defers the text of every step but the stop string's."""
    inline, deferred = engine_pair(llama_dir, speculative_config=speculative)
    assert not inline.engine.defer_text and deferred.engine.defer_text
    probe = inline.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_text = probe.outputs[0].text[4:7]  # a stop string its greedy continuation is known to reach
    assert stop_text.strip()
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[0], PROMPTS[1]]  # the stop string's request: PROMPTS[0]
    params = request_mix(stop_text)
    if mix == "sync-free":
        params[2] = SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=9, ignore_eos=True)
        params[4] = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[7, 11, 13], ignore_eos=True)
    expected = summary(inline.generate(prompts, params))
    assert expected[3][0][2] == "stop" and expected[3][0][3] == stop_text
    processor, deferred_tokens = deferred.engine.outputs, []
    take_text = processor.deferred_outputs
    processor.deferred_outputs = lambda: deferred_tokens.append(len(processor._deferred)) or take_text()
    outputs = deferred.generate(prompts, params)
    assert summary(outputs) == expected
    if mix == "sync-free" and speculative is None:  # every token but the stop string request's was deferred
        assert sum(deferred_tokens) == sum(len(c.token_ids) for i, o in enumerate(outputs) if i != 3 for c in o.outputs)
    assert sum(deferred_tokens) > 0
    assert deferred.engine.block_manager.usage == 0 and not deferred.engine.outputs.has_deferred


@CUDA
def test_on_cuda_text_is_deferred_by_default_and_outputs_do_not_change(llama_dir):
    """On a GPU the sampled ids come back through a pinned copy that `SampleResult.wait` waits for."""
    # fixed caches, not 90% of the GPU each: two engines here, and GPU tests share one
    inline = LLM(llama_dir, block_size=4, device="cuda", async_output_processing=False, num_kv_blocks=128)
    deferred = LLM(llama_dir, block_size=4, device="cuda", num_kv_blocks=128)
    assert deferred.engine.defer_text and deferred.engine.runner.defer_token_copy
    params = request_mix(stop_text="\n")
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    assert summary(deferred.generate(prompts, params)) == summary(inline.generate(prompts, params))


def test_the_text_of_a_step_is_done_after_the_next_step_is_launched(llama_dir):
    engine = LLM(llama_dir, block_size=4, async_output_processing=True).engine
    events = []
    execute = engine.runner.execute

    def launch(batch):
        events.append("launch")
        return execute(batch)

    engine.runner.execute = launch
    request = engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    detokenizer = request.completions[0].detokenizer
    add_token = detokenizer.add_token
    detokenizer.add_token = lambda token: events.append("text") or add_token(token)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    # Token k's text waits for launch k + 1; the last token's for the step that finds nothing to launch.
    assert events == ["launch", "launch", "text", "launch", "text", "launch", "text", "text"]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3, 4] and outputs[-1].finished


def test_text_that_cannot_be_decoded_ends_its_request_alone(llama_dir):
    engine = LLM(llama_dir, block_size=4, max_num_seqs=2, async_output_processing=True).engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    broken = engine.add_request("broken", PROMPTS[0], params)
    engine.add_request("fine", PROMPTS[1], params)
    detokenizer = broken.completions[0].detokenizer
    add_token = detokenizer.add_token
    calls = []

    def failing(token):
        calls.append(token)
        if len(calls) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return add_token(token)

    detokenizer.add_token = failing
    finished = run_all(engine)
    assert finished["broken"].outputs[0].finish_reason == "abort" and "injected" in finished["broken"].error
    reference = LLM(llama_dir, block_size=4).generate([PROMPTS[1]], params)[0]
    assert summary([finished["fine"]]) == summary([reference])
    assert_block_invariant(engine) and engine.block_manager.usage == 0


def final_output_of_a_failed_step(llm: LLM, failing_call: int):
    """One greedy request whose `failing_call`-th model step raises: the final output the failure carries,
    once the engine is checked to hold nothing more (no request, no block)."""
    engine = llm.engine
    FailingSteps(engine.runner, {failing_call}, RuntimeError("injected"))
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    with pytest.raises(StepFailedError) as failure:
        for _ in range(failing_call):
            engine.step()
    final = failure.value.outputs[-1]
    assert final.finished and "injected" in final.error
    assert not engine.has_unfinished_requests() and engine.block_manager.usage == 0
    return final


def test_a_failed_step_still_delivers_the_text_of_the_step_before(llama_dir):
    finals = [final_output_of_a_failed_step(llm, failing_call=3) for llm in engine_pair(llama_dir)]
    assert all(len(final.outputs[0].token_ids) == 2 for final in finals)
    assert summary(finals[1:]) == summary(finals[:1])  # the text of both tokens, as without deferral


def test_an_abort_drops_the_text_still_waiting(llama_dir):
    engine = LLM(llama_dir, block_size=4, async_output_processing=True).engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("gone", PROMPTS[0], params)
    engine.add_request("kept", PROMPTS[1], params)
    engine.step()
    assert engine.abort("gone")
    assert_block_invariant(engine)
    finished = run_all(engine)
    assert "gone" not in finished
    reference = LLM(llama_dir, block_size=4).generate([PROMPTS[1]], params)[0]
    assert summary([finished["kept"]]) == summary([reference]) and engine.block_manager.usage == 0


def test_streams_from_the_async_engine_are_whole(llama_dir):
    """Deferred outputs go to the slots inside the next step (`deliver_early`): each stream still ends
    with the same final output, and its cumulative texts only grow."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = summary(LLM(llama_dir, block_size=4).generate(PROMPTS, params))
    engine = AsyncEngine(LLM(llama_dir, block_size=4, async_output_processing=True).engine)
    assert engine.engine.deliver_early is not None

    async def collect(prompt):
        return [o async for o in engine.generate(prompt, params)]

    async def main():
        return await asyncio.gather(*(collect(p) for p in PROMPTS))

    engine.start()
    try:
        streams = asyncio.run(main())
    finally:
        engine.shutdown()
    assert summary([s[-1] for s in streams]) == expected
    for stream in streams:
        texts = [o.outputs[0].text for o in stream]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and stream[-1].finished


def test_the_flag_and_the_default(llama_dir):
    import argparse

    from kubeinfer.engine.entrypoints.serve import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["/models/x"]).async_output_processing is None  # the engine decides: on with CUDA
    assert parser.parse_args(["/models/x", "--disable-async-output-proc"]).async_output_processing is False
    engine = LLM(llama_dir, block_size=4).engine
    assert not engine.defer_text and not engine.runner.defer_token_copy  # the CPU: nothing would overlap
