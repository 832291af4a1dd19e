"""Sampling maths on hand-made logits; references: transformers' logits processors and the definitions."""
import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper

from kubeinfer.engine.model_executor.sampler import _apply_penalties, sample
from kubeinfer.engine.sampling_params import SamplingParams
from kubeinfer.engine.sequence import Sequence

VOCAB = 8


def seqs_for(params: SamplingParams, count: int, prompt=(1, 2), output=(), seed0=0):
    out = []
    for i in range(count):
        seq = Sequence("r", list(prompt), params, torch.Generator().manual_seed(seed0 + i))
        for t in output:
            seq.append_token(t)
        out.append(seq)
    return out


def draws(logits_row, params, count=3000):
    seqs = seqs_for(params, count)
    logits = torch.tensor(logits_row, dtype=torch.float32).expand(count, -1)
    return torch.tensor(sample(logits, seqs).token_ids)


PROBS = [0.5, 0.3, 0.1, 0.05, 0.03, 0.01, 0.005, 0.005]
LOGITS = [math.log(p) for p in PROBS]


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    seqs = [seqs_for(SamplingParams(temperature=0), 1)[0] for _ in range(5)]
    assert sample(logits, seqs).token_ids == logits.argmax(-1).tolist()


def test_plain_sampling_follows_the_distribution():
    tokens = draws(LOGITS, SamplingParams(temperature=1.0))
    freq = torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)
    assert torch.allclose(freq, torch.tensor(PROBS), atol=0.03)


def test_temperature_matches_transformers_warper():
    params = SamplingParams(temperature=0.5)
    expected = torch.softmax(TemperatureLogitsWarper(0.5)(None, torch.tensor([LOGITS])), -1)[0]
    freq = torch.bincount(draws(LOGITS, params), minlength=VOCAB).float() / 3000
    assert torch.allclose(freq, expected, atol=0.03)


def test_top_k_never_samples_outside_k():
    tokens = draws(LOGITS, SamplingParams(top_k=2))
    assert set(tokens.tolist()) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.5 + 0.3 = 0.8 >= 0.75: tokens 0 and 1 only
    assert set(draws(LOGITS, SamplingParams(top_p=0.75)).tolist()) == {0, 1}
    # 0.5 + 0.3 + 0.1 = 0.9 >= 0.85: three tokens
    assert set(draws(LOGITS, SamplingParams(top_p=0.85)).tolist()) == {0, 1, 2}


def test_min_p_is_relative_to_the_top_token():
    # threshold 0.15 * 0.5 = 0.075: the tokens with p >= 0.1 stay, 0.05 goes
    assert set(draws(LOGITS, SamplingParams(min_p=0.15)).tolist()) == {0, 1, 2}


def test_filters_combine():
    assert set(draws(LOGITS, SamplingParams(top_k=3, top_p=0.6)).tolist()) == {0, 1}


def test_repetition_penalty_matches_transformers():
    params = SamplingParams(repetition_penalty=1.7)
    seq = seqs_for(params, 1, prompt=(1, 3), output=(5, 3))[0]
    logits = torch.tensor([[0.5, 2.0, -1.0, -3.0, 0.1, 4.0, -0.2, 1.0]])
    ours = logits.clone()
    _apply_penalties(ours, [seq])
    reference = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([seq.token_ids]), logits.clone())
    assert torch.allclose(ours, reference)
    assert not torch.equal(ours, logits)


def test_frequency_and_presence_penalties_follow_openai_definition():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    seq = seqs_for(params, 1, prompt=(1,), output=(2, 2, 2, 4))[0]
    logits = torch.zeros(1, VOCAB)
    _apply_penalties(logits, [seq])
    expected = torch.zeros(VOCAB)
    expected[2] = -(3 * 0.5 + 0.25)
    expected[4] = -(1 * 0.5 + 0.25)
    assert torch.allclose(logits[0], expected)  # the prompt token 1 is not penalized


def test_penalties_change_what_greedy_picks():
    logits = torch.tensor([[3.0, 2.9, 0, 0, 0, 0, 0, 0]])
    plain = seqs_for(SamplingParams(temperature=0), 1, output=(0,))
    penalized = seqs_for(SamplingParams(temperature=0, presence_penalty=0.5), 1, output=(0,))
    assert sample(logits, plain).token_ids == [0]
    assert sample(logits, penalized).token_ids == [1]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    params.eos_token_ids = frozenset({0})
    logits = torch.tensor([[5.0, 1, 0, 4.0, 0, 0, 0, 0]])
    early = seqs_for(params, 1, output=(7,))
    assert sample(logits, early).token_ids == [1]
    late = seqs_for(params, 1, output=(7, 7))
    assert sample(logits, late).token_ids == [0]


def test_logit_bias_is_added_after_penalties():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0, 0, 0, 0]])
    params = SamplingParams(repetition_penalty=2.0, logit_bias={0: 1.0, 1: 0.5, 2: -100, 6: 0.25})
    # by hand: tokens 0 and 2 were seen (2.0 / 2, -1.0 * 2), then the biases (token 0: 41% of draws;
    # biased before the penalty, (2.0 + 1.0) / 2, it would get 30%)
    reference = torch.softmax(torch.tensor([2.0, 1.5, -102.0, 0.5, 0, 0, 0.25, 0]), -1)
    seqs = seqs_for(params, 3000, prompt=(0, 2))
    freq = torch.bincount(torch.tensor(sample(logits.expand(3000, -1), seqs).token_ids), minlength=VOCAB) / 3000
    assert torch.allclose(freq, reference, atol=0.03)


def test_logit_bias_moves_greedy_and_leaves_other_rows_alone():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0, 0, 0, 0, 0]]).expand(3, -1)
    params = [SamplingParams(temperature=0, logit_bias={0: -100}), SamplingParams(temperature=0, logit_bias={5: 100}),
              SamplingParams(temperature=0)]
    seqs = [seqs_for(p, 1)[0] for p in params]
    assert sample(logits, seqs).token_ids == [1, 5, 0]


def test_allowed_token_ids_restrict_sampling_to_them():
    params = SamplingParams(temperature=1.0, allowed_token_ids=[2, 4, 5])
    # by hand: the distribution renormalized over tokens 2, 4 and 5
    allowed = torch.tensor([0, 0, PROBS[2], 0, PROBS[4], PROBS[5], 0, 0])
    freq = torch.bincount(draws(LOGITS, params), minlength=VOCAB).float() / 3000
    assert torch.allclose(freq, allowed / allowed.sum(), atol=0.03)
    greedy = SamplingParams(temperature=0, allowed_token_ids=[3, 6])
    assert sample(torch.tensor([LOGITS]), seqs_for(greedy, 1)).token_ids == [3]


def test_allowed_tokens_win_over_logit_bias_and_top_k():
    params = SamplingParams(temperature=1.0, top_k=1, allowed_token_ids=[6, 7], logit_bias={0: 100, 7: 5})
    assert set(draws(LOGITS, params, count=200).tolist()) == {7}


def test_same_seed_same_tokens_whatever_the_batch():
    params = SamplingParams(temperature=1.0, seed=42)
    logits = torch.randn(1, 200, generator=torch.Generator().manual_seed(3))

    def run(batch_extra):
        target = seqs_for(params, 1, seed0=42)[0]
        others = seqs_for(SamplingParams(temperature=0.7), batch_extra, seed0=1000)
        batch = others[: batch_extra // 2] + [target] + others[batch_extra // 2:]
        stacked = torch.cat([torch.randn(1, 200) for _ in others[: batch_extra // 2]] + [logits]
                            + [torch.randn(1, 200) for _ in others[batch_extra // 2:]])
        tokens = []
        for _ in range(10):
            tokens.append(sample(stacked, batch).token_ids[batch.index(target)])
        return tokens

    assert run(0) == run(3) == run(8)


def test_logprobs_are_raw_log_softmax_with_rank():
    params = SamplingParams(temperature=0, logprobs=3, presence_penalty=1.0)
    seq = seqs_for(params, 1)[0]
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, 0, 0, 0, 0]])
    result = sample(logits, [seq])
    logprob, rank, top = result.logprobs[0]
    reference = torch.log_softmax(logits[0], -1)
    assert result.token_ids == [1] and rank == 1
    assert logprob == pytest.approx(reference[1].item())
    assert [t for t, _ in top] == [1, 2, 0]
    assert [lp for _, lp in top] == pytest.approx(reference[[1, 2, 0]].tolist())


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2), ("repetition_penalty", 0),
    ("frequency_penalty", 3), ("presence_penalty", -3), ("max_tokens", 0), ("n", 0), ("min_tokens", -1),
    ("logprobs", -1), ("seed", "x"), ("seed", 2**64), ("seed", -2**63 - 1), ("stop", [""]),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}), ("logit_bias", {5: 100.5}),
    ("logit_bias", {5: float("nan")}),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", [True]),
])
def test_invalid_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_seed_takes_every_64_bit_value():
    for seed in (-2**63, -1, 0, 2**64 - 1):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)


def test_token_ids_outside_the_vocabulary_are_refused():
    params = SamplingParams(logit_bias={3: 1.0, 9: 1.0}, allowed_token_ids=[1, 2])
    params.check_token_ids(10)
    with pytest.raises(ValueError, match="^logit_bias .* 9"):
        params.check_token_ids(9)
    with pytest.raises(ValueError, match="^allowed_token_ids .* 8"):
        SamplingParams(allowed_token_ids=[8]).check_token_ids(8)


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_sampling_runs_where_the_logits_are(device):
    """Penalties, filters, seeded draws and logprobs on the logits' own device (a GPU's, in serving):
    only token ids and the asked-for logprobs come back to the host."""
    def seqs(params, count, seed0=0):
        return [Sequence("r", [1, 2], params, torch.Generator(device=device).manual_seed(seed0 + i))
                for i in range(count)]

    logits = torch.tensor(LOGITS, device=device).expand(2000, -1)
    tokens = sample(logits, seqs(SamplingParams(top_p=0.75, presence_penalty=0.1), 2000)).token_ids
    assert set(tokens) == {0, 1} and all(isinstance(t, int) for t in tokens)
    seeded = SamplingParams(temperature=0.9, seed=7)
    assert sample(logits[:4], seqs(seeded, 4)).token_ids == sample(logits[:4], seqs(seeded, 4)).token_ids
    result = sample(logits[:1], seqs(SamplingParams(temperature=0, logprobs=2, repetition_penalty=1.3), 1))
    logprob, rank, top = result.logprobs[0]
    assert result.token_ids == [0] and rank == 1 and [t for t, _ in top] == [0, 1]
    assert logprob == pytest.approx(math.log(PROBS[0]), abs=1e-5)
    biased = SamplingParams(temperature=0.8, logit_bias={5: 100}, allowed_token_ids=[4, 5])
    assert set(sample(logits[:50], seqs(biased, 50)).token_ids) == {5}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, seed=4)])
def test_deferred_copy_waits_for_the_device_and_changes_no_token(params):
    logits = torch.randn(64, 1000, device="cuda")

    def seqs():
        return [Sequence("r", [1, 2], params, torch.Generator(device="cuda").manual_seed(i)) for i in range(64)]
    result = sample(logits, seqs(), defer_copy=True)
    assert result.async_copy and not isinstance(result.token_ids, list)
    result.wait()
    assert result.token_ids == sample(logits, seqs()).token_ids
