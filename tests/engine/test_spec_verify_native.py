"""Speculative decoding's verify step on the native decode path, and the batch-1 switch on measured step costs.

The verify step (a token and its k drafts) runs as 1 + k one-token queries (StepInputs.add_as_decodes) where a
decode step's attention is native: the decode attention for every row, and the fused decoder layers of a model
whose layers qualify (W8A16 here), whose arithmetic is a token's whatever the batch. The reference is the engine
without speculation: greedy outputs token for token the same, at batch 1 and in a mixed batch. The batch-1 switch
(spec_decode/step_costs.py) gets its step costs injected: a verify step that loses turns speculation off for a
while, one that wins keeps it on."""
from __future__ import annotations

import pytest
from quant_checkpoints import SHAPE, ct_compress, ct_scheme, float_weights, write_checkpoint

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.platforms.cpu.native import ops
from kubeinfer.engine.platforms.cpu import native_decode
from kubeinfer.engine.spec_decode import step_costs
from kubeinfer.engine.spec_decode.step_costs import StepCosts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
LOOPING = [[11, 12, 13, 14, 15, 16, 17] * 3, list(range(40, 52)) * 2, [7, 8, 7, 8, 7, 8, 7]]
native = pytest.mark.skipif(not ops.available(), reason="no C compiler: the native kernels do not build here")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n))]


class Oracle:
    """Proposes the reference continuation (no speculation's output) of the prompts it knows, every third
    proposal's last draft spoiled: full and partial acceptance both happen (a random model copies little)."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.known, self.calls = list(zip(prompts, outputs)), 0

    def propose(self, token_ids: list[int], num_tokens: int, owner=None) -> list[int]:
        for prompt, output in self.known:
            done = len(token_ids) - len(prompt)
            if token_ids[:len(prompt)] == prompt and token_ids[len(prompt):] == output[:done]:
                drafts = output[done:done + num_tokens]
                self.calls += 1
                if drafts and self.calls % 3 == 0:
                    drafts[-1] = (drafts[-1] + 1) % 96
                return drafts
        return []


def record_steps(llm: LLM) -> list[tuple[bool, int, int, int]]:
    """(drafts in the step, decode rows, sequences as the attention sees them, tokens) of every step the runner
    prepares from now on."""
    runner, seen = llm.engine.runner, []
    prepare = runner.prepare

    def spy(batch):
        inputs, seqs = prepare(batch)
        seen.append((any(s.spec_token_ids for s, _ in batch.entries), inputs.num_decodes, len(inputs.context_lens),
                     len(inputs.input_ids)))
        return inputs, seqs
    runner.prepare = spy
    return seen


@pytest.fixture(scope="module")
def w8a16_dir(tmp_path_factory) -> str:
    from kubeinfer.dev.testing.random_model import build_random_model

    root = tmp_path_factory.mktemp("spec_native")
    float_dir = build_random_model(root / "float", "llama", tokenizer=False, seed=4, vocab_size=96, **SHAPE)
    config = ct_scheme("pack-quantized", 8, "int", "channel", True, None)
    return write_checkpoint(float_dir, root / "w8a16", ct_compress(float_weights(float_dir), config), config)


@native
def test_verify_rows_run_as_native_decodes_and_match_no_speculation(llama_dir):
    plain = generate(LLM(llama_dir, block_size=4), LOOPING, 24)
    llm = LLM(llama_dir, block_size=4, speculative_config=NGRAM)
    assert llm.engine.runner.verify_as_decodes()
    llm.engine.speculator.proposer = Oracle(LOOPING, plain)
    steps = record_steps(llm)
    got = [generate(llm, [p], 24)[0] for p in LOOPING] + generate(llm, LOOPING, 24)  # batch 1, then mixed
    assert got == plain + plain
    verifying = [s for s in steps if s[0]]
    assert verifying and llm.engine.speculator.num_accepted_tokens > 0
    # every decoding step, drafts or not, is all one-token queries: one per token
    assert all(decodes == seqs == tokens for _, decodes, seqs, tokens in verifying)
    assert any(tokens > 1 for _, _, _, tokens in verifying)


@native
def test_generic_verify_when_switched_off_gives_the_same_tokens(llama_dir):
    """The A/B switch (model runner's native_verify) keeps the chunk path: one query of 1 + k tokens."""
    llm = LLM(llama_dir, block_size=4, speculative_config=NGRAM)
    llm.engine.runner.native_verify = False
    steps = record_steps(llm)
    assert generate(llm, LOOPING[:1], 24) == generate(LLM(llama_dir, block_size=4), LOOPING[:1], 24)
    assert any(drafts and decodes == 0 and tokens > 1 for drafts, decodes, _, tokens in steps)


@native
def test_verify_step_takes_the_fused_native_layers(w8a16_dir, monkeypatch):
    """W8A16 layers run a decode step in one native call each: a verify step of 1 + k tokens too (before, its
    rows went one module at a time, the attention as a masked SDPA); greedy tokens equal no speculation's."""
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "cpu_int8_a16")
    plain = generate(LLM(w8a16_dir, max_model_len=128), LOOPING, 32)
    llm = LLM(w8a16_dir, max_model_len=128, speculative_config=NGRAM)
    llm.engine.speculator.proposer = Oracle(LOOPING, plain)
    assert native_decode.all_layers_native(llm.engine.runner.model)
    calls = []
    forward_layers = native_decode.forward_layers

    def spy(model, x, *args):
        out = forward_layers(model, x, *args)
        calls.append((x.shape[0], out is not None))
        return out
    monkeypatch.setattr(native_decode, "forward_layers", spy)
    assert [generate(llm, [p], 32)[0] for p in LOOPING] == plain
    assert generate(llm, LOOPING, 32) == plain
    assert llm.engine.speculator.num_accepted_tokens > 0
    assert any(rows > 1 and fused for rows, fused in calls if rows <= 5)  # batch 1: a verify step's 2-5 rows


def test_step_costs_switch_off_when_verify_loses_and_back_after_the_pause():
    costs = StepCosts(probe_every=8, min_samples=3)
    assert not costs.speculate()  # nothing measured yet: a plain step first
    costs.record(0.010, None)
    for _ in range(3):  # a verify step costs 3x a plain one and yields 2 tokens: 0.67x
        assert costs.speculate()
        costs.record(0.030, 2)
    assert costs.times_off == 1 and costs.gain == 0.0  # measured afresh after the pause
    off = [costs.speculate() for _ in range(step_costs.FIRST_PAUSE)]
    assert not any(off[:-1]) and off[-1]
    for _ in range(3):
        costs.record(0.030, 2)
        costs.speculate()
    assert costs.times_off == 2 and costs.pause == 4 * step_costs.FIRST_PAUSE  # doubled


def test_step_costs_stay_on_when_verify_wins_and_probe_plain_steps():
    costs = StepCosts(probe_every=8, min_samples=3)
    costs.speculate()
    costs.record(0.010, None)
    decisions = []
    for _ in range(40):
        on = costs.speculate()
        decisions.append(on)
        costs.record(0.012, 4) if on else costs.record(0.010, None)  # 4 tokens for 1.2x the cost: 3.3x
    assert costs.times_off == 0 and costs.gain == pytest.approx(4 / 1.2)
    assert decisions.count(False) == 40 // 9  # one plain step after every 8 verify steps
    assert decisions[:8] == [True] * 8 and not decisions[8]


@pytest.mark.parametrize("verify_cost, speculates", [(10.0, False), (1.0, True)])
def test_engine_turns_speculation_off_at_batch_1_when_injected_costs_say_it_loses(llama_dir, verify_cost, speculates):
    """Step costs injected where the engine reports them: a plain step 1.0, a verify step verify_cost. At 10x no
    verify step can win (at most 5 tokens): after the switch's first samples, speculation stops for the pause (longer
    than the rest of the request); at 1.0 every verify step wins (at least one token)."""
    tokens = 36  # a plain step, min_samples verify steps, then the pause (FIRST_PAUSE steps) to the end
    plain = generate(LLM(llama_dir, block_size=4), LOOPING[:1], tokens)
    llm = LLM(llama_dir, block_size=4, speculative_config=NGRAM)
    speculator = llm.engine.speculator
    speculator.proposer = Oracle(LOOPING[:1], plain)
    step_done = speculator.step_done

    def injected(batch, seconds):
        step_done(batch, verify_cost if speculator._verified else 1.0)
    speculator.step_done = injected
    steps = record_steps(llm)
    assert generate(llm, LOOPING[:1], tokens) == plain
    verifying = sum(drafts for drafts, *_ in steps)
    if speculates:
        assert speculator.costs.times_off == 0 and verifying > 5
    else:
        assert speculator.costs.times_off >= 1 and verifying <= speculator.costs.min_samples
