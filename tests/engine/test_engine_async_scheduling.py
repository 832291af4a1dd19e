"""Async scheduling: step N+1 is scheduled and launched before step N's ids reach the host (its pending
tokens filled in on the device). On the CPU the forward is synchronous, so nothing overlaps here; these
tests check what must not change: every output against the synchronous engine, under EOS, stop strings,
length limits, preemption, prefix caching, aborts and failed steps, and the fallback for requests whose
next step needs the ids on the host."""
from __future__ import annotations

import pytest
from test_engine_deferred_text import PROMPTS, final_output_of_a_failed_step
from test_engine_faults import assert_block_invariant, run_all

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.sequence import PENDING_TOKEN


def pair(llama_dir, **kwargs):
    return LLM(llama_dir, block_size=4, **kwargs), LLM(llama_dir, block_size=4, async_scheduling=True, **kwargs)


def summary(outputs) -> list:
    """Every field of every completion; logprobs to 1e-3, since running ahead can change which sequences share
    a step (under preemption), and with them the floating-point sums of the batched products."""
    return [[(c.text, c.token_ids, c.finish_reason, c.stop_reason,
              None if c.cumulative_logprob is None else round(c.cumulative_logprob, 3),
              None if c.logprobs is None else [{t: (round(lp.logprob, 3), lp.rank, lp.decoded_token)
                                                 for t, lp in entry.items()} for entry in c.logprobs])
             for c in o.outputs] for o in outputs]


def no_pending_token(outputs) -> bool:
    return all(PENDING_TOKEN not in c.token_ids for o in outputs for c in o.outputs)


def mix(stop_text: str) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=12),  # may end on EOS
            SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=10, n=2),
            SamplingParams(temperature=0, max_tokens=9, logprobs=2, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=12, stop=[stop_text], ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[7, 11, 13], min_tokens=2, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]


@pytest.mark.parametrize("engine_args", [{}, {"max_num_seqs": 2}, {"num_kv_blocks": 12}],
                         ids=["plain", "queued", "preempting"])
def test_outputs_are_the_same_as_the_synchronous_engine(llama_dir, engine_args):
    sync, ahead = pair(llama_dir, **engine_args)
    probe = sync.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_text = probe.outputs[0].text[4:7]
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    params = mix(stop_text)
    expected = summary(sync.generate(prompts, params))
    assert expected[3][0][2] == "stop"
    launched = ahead.engine.runner.execute
    pending_inputs = []

    def counting(batch, previous_ids=None):
        pending_inputs.append(sum(seq.token_ids[-1] == PENDING_TOKEN for seq, _ in batch.entries))
        return launched(batch, previous_ids)

    ahead.engine.runner.execute = counting
    outputs = ahead.generate(prompts, params)
    assert summary(outputs) == expected and no_pending_token(outputs)
    assert sum(pending_inputs) > len(prompts)  # most steps ran ahead: their inputs were still on the device
    engine = ahead.engine
    assert not engine.has_unfinished_requests() and engine.block_manager.usage == 0
    if engine_args.get("num_kv_blocks"):
        assert engine.scheduler.num_preemptions > 0


def test_the_prefix_cache_registers_real_tokens_only(llama_dir):
    """A reply's blocks are registered once their ids are known: the same conversation sent again hits them."""
    sync, ahead = pair(llama_dir)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = ahead.generate([PROMPTS[0]], params)[0]
    again = {"prompt_token_ids": first.prompt_token_ids + first.outputs[0].token_ids + [5, 6]}
    reply = ahead.generate([again], params)[0]
    assert reply.num_cached_tokens >= 4 * ((len(again["prompt_token_ids"]) - 2) // 4) - 4
    assert summary([reply]) == summary(sync.generate([again], params))


def test_requests_that_need_the_ids_on_the_host_run_synchronously(llama_dir):
    sync, ahead = pair(llama_dir)
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, frequency_penalty=0.5,
                             ignore_eos=True)]
    prompts = [PROMPTS[0], PROMPTS[1]]
    expected = summary(sync.generate(prompts, params))
    launched = []
    execute = ahead.engine.runner.execute
    ahead.engine.runner.execute = lambda batch, previous_ids=None: launched.append(previous_ids) or execute(
        batch, previous_ids)
    assert summary(ahead.generate(prompts, params)) == expected
    assert launched[0] is None and any(p is not None for p in launched[9:])  # ahead once the penalties are gone
    assert all(p is None for p in launched[:8])


def test_an_abort_while_a_step_runs_ahead(llama_dir):
    sync, ahead = pair(llama_dir)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = ahead.engine
    engine.add_request("gone", PROMPTS[0], params)
    engine.add_request("kept", PROMPTS[1], params)
    engine.step()
    engine.step()
    assert engine.abort("gone")
    assert_block_invariant(engine)
    finished = run_all(engine)
    assert set(finished) == {"kept"} and no_pending_token(finished.values())
    assert summary([finished["kept"]]) == summary(sync.generate([PROMPTS[1]], params))
    assert engine.block_manager.usage == 0


def test_a_failed_step_delivers_the_tokens_of_the_step_before(llama_dir):
    finals = [final_output_of_a_failed_step(llm, failing_call=4) for llm in pair(llama_dir)]
    assert no_pending_token(finals) and len(finals[0].outputs[0].token_ids) == 3
    assert summary(finals[1:]) == summary(finals[:1])  # the same three tokens, with or without running ahead


def test_the_flag(llama_dir):
    import argparse

    from kubeinfer.engine.entrypoints.serve import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["/models/x", "--async-scheduling"]).async_scheduling is True
    assert parser.parse_args(["/models/x"]).async_scheduling is False
    assert LLM(llama_dir, block_size=4).engine.pipeline is None


def test_adapters_mixed_in_one_batch_run_ahead_to_what_peft_gives(lora_base_dir, lora_adapters,
                                                                   lora_base_reference):
    """Each request on its own adapter (or none), all in one batch, running ahead: transformers + PEFT's tokens."""
    from lora_helpers import MAX_TOKENS
    from lora_helpers import PROMPTS as LORA_PROMPTS

    llm = LLM(str(lora_base_dir), enable_lora=True, max_loras=3, max_lora_rank=8, block_size=4, async_scheduling=True)
    names = ["attn", "mlp", "all", None]
    requests = [lora_adapters[n][0] if n else None for n in names]
    want = [lora_adapters[n][1][i] if n else lora_base_reference[i] for i, n in enumerate(names)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in LORA_PROMPTS],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), lora_request=requests)
    assert [o.outputs[0].token_ids for o in outputs] == want
