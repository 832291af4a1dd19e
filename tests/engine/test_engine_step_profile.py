"""The step timer (issue 21): off by default, every phase of a decode step charged when on, a DEBUG log
line with the split; and the CPU decode fast paths it led to keep outputs unchanged."""
import logging

import pytest
import torch
from torch import nn

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.model_executor.sampler import sample
from kubeinfer.engine.model_executor.step_timer import PHASES
from kubeinfer.engine.sequence import Sequence

PROMPTS = [[11, 12, 13, 14, 15], [40, 41, 42], list(range(60, 80))]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_timer_is_off_by_default_and_records_nothing(llama_dir):
    engine = LLM(llama_dir, num_kv_blocks=32).engine
    engine.add_request("a", PROMPTS[0], greedy(4))
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.step_timer.enabled and engine.step_timer.records == []


@pytest.mark.parametrize("deferred_text", [False, True])
def test_every_phase_of_a_decode_step_is_charged(llama_dir, deferred_text):
    llm = LLM(llama_dir, num_kv_blocks=64, async_output_processing=deferred_text)
    reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(6))]
    timer = llm.engine.step_timer
    timer.enabled = timer.keep_records = True
    timed = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(6))]
    timer.finish()
    assert timed == reference  # timing changes nothing
    decodes = [phases for num_seqs, decode, phases in timer.records if decode and num_seqs == len(PROMPTS)]
    assert decodes, timer.records
    for phases in decodes:
        expected = set(PHASES) if deferred_text else set(PHASES) - {"text"}  # "text": the deferred text's work
        assert set(phases) == expected and all(seconds >= 0 for seconds in phases.values())
        assert phases["forward"] > 0


def test_debug_log_line_gives_the_split(llama_dir, caplog):
    caplog.set_level(logging.DEBUG, logger="kubeinfer.engine.step_profile")
    llm = LLM(llama_dir, num_kv_blocks=32)
    llm.engine.step_timer.log.interval = 3
    llm.generate([PROMPTS[1]], greedy(8))
    lines = [r.getMessage() for r in caplog.records if r.name == "kubeinfer.engine.step_profile"]
    assert lines and all(line.startswith("step profile: 3 steps") for line in lines)
    assert all(f"{phase} " in lines[0] for phase in PHASES) and "host (not forward)" in lines[0]


def test_greedy_fast_path_equals_the_full_sampler():
    """Plain greedy rows take one argmax; a row asking for logprobs takes the full path: same tokens."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the first index wins on both paths

    def seqs(params):
        return [Sequence("r", [1, 2], params, torch.Generator().manual_seed(i)) for i in range(6)]
    fast = sample(logits, seqs(SamplingParams(temperature=0)))
    full = sample(logits, seqs(SamplingParams(temperature=0, logprobs=1)))
    assert fast.token_ids == full.token_ids == logits.argmax(-1).tolist()
    assert fast.logprobs == [None] * 6 and all(lp is not None for lp in full.logprobs)


def test_min_tokens_still_bans_eos_on_the_greedy_path():
    logits = torch.zeros(1, 10)
    logits[0, 3] = 5.0  # token 3 is EOS and the argmax
    params = SamplingParams(temperature=0, min_tokens=2)
    params.eos_token_ids = frozenset({3})
    seq = Sequence("r", [1], params, torch.Generator().manual_seed(0))
    assert sample(logits, [seq]).token_ids != [3]


def test_checkpoint_layout_can_be_kept(llama_dir, monkeypatch):
    monkeypatch.setenv("KUBEINFER_CPU_COLUMN_MAJOR_WEIGHTS", "0")
    model = LLM(llama_dir, num_kv_blocks=16).engine.runner.model
    assert all(m.weight.is_contiguous() for m in model.modules() if isinstance(m, nn.Linear))
