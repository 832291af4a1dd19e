"""The rejection sampler preserves the target distribution: many seeded draws on a six-token vocabulary,
against a target computed here by hand (temperature, top-k, penalties, logit_bias), with a chi-square bound;
greedy verification; and the n-gram proposer and config parsing on their own."""
from __future__ import annotations

import pytest
import torch

from kubeinfer.engine.sampling_params import SamplingParams
from kubeinfer.engine.sequence import Sequence
from kubeinfer.engine.spec_decode.config import SpeculativeConfig
from kubeinfer.engine.spec_decode.ngram import NgramProposer
from kubeinfer.engine.spec_decode.rejection_sampler import verify

# Chi-square critical values at alpha = 0.001, by degrees of freedom (standard tables).
CHI2_CRITICAL_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458}
DRAWS = 6000
LOGITS = torch.tensor([[1.0, 0.2, -0.5, 0.8, 0.0, -1.0],
                       [0.3, 1.2, 0.1, -0.2, 0.9, 0.4],
                       [-0.4, 0.5, 1.1, 0.0, 0.2, 0.7]])
PROMPT = [0, 3]


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny tensor ops: with two threads on a busy shared machine each op waits milliseconds
    for the pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_seq(params: SamplingParams, drafts: list[int], output: list[int] = (), seed: int = 0) -> Sequence:
    seq = Sequence("r", PROMPT, params, torch.Generator().manual_seed(seed))
    seq.token_ids += list(output)
    seq.spec_token_ids = list(drafts)
    return seq


def reference_target(row: torch.Tensor, params: SamplingParams, tokens: list[int], output: list[int]) -> torch.Tensor:
    """The distribution a normal step samples from, written out by hand for this test's few parameters."""
    logits = row.clone().double()
    for t in set(tokens):
        if params.repetition_penalty != 1.0:
            logits[t] = logits[t] / params.repetition_penalty if logits[t] > 0 else logits[t] * params.repetition_penalty
    for t in set(output):
        logits[t] -= params.presence_penalty + params.frequency_penalty * output.count(t)
    for t, bias in (params.logit_bias or {}).items():
        logits[t] += bias
    probs = torch.softmax(logits / params.temperature, dim=0)
    if params.top_k:
        probs[probs.argsort(descending=True)[params.top_k:]] = 0
    return probs / probs.sum()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was drawn"
    kept = probs > 0
    expected = probs[kept] * counts.sum()
    return float(((counts[kept] - expected) ** 2 / expected).sum()), int(kept.sum()) - 1


PARAMS = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k, penalties and bias": SamplingParams(temperature=1.3, top_k=4, repetition_penalty=1.4, presence_penalty=0.6,
                                                frequency_penalty=0.3, logit_bias={5: 1.5, 0: -0.7}),
}


@pytest.mark.parametrize("name", PARAMS)
def test_rejection_sampling_preserves_the_target_distribution(name):
    params, output, drafts = PARAMS[name], [1], [4, 1]  # 4: kept by top-k, and penalised once drafted
    first = torch.zeros(6)
    second_after_accept = torch.zeros(6)
    for trial in range(DRAWS):
        seq = make_seq(params, drafts, output, seed=trial)
        result = verify(LOGITS, [seq])
        emitted = result.accepted[0] + [result.token_ids[0]]
        assert result.accepted[0] == drafts[:len(result.accepted[0])]
        first[emitted[0]] += 1
        if emitted[0] == drafts[0]:
            second_after_accept[emitted[1]] += 1
    tokens = PROMPT + output
    p0 = reference_target(LOGITS[0], params, tokens, output)
    # After the first draft is accepted, row 1's target sees it as generated (penalties included).
    p1 = reference_target(LOGITS[1], params, tokens + drafts[:1], output + drafts[:1])
    for counts, probs in ((first, p0), (second_after_accept, p1)):
        statistic, df = chi_square(counts, probs)
        assert statistic < CHI2_CRITICAL_001[df], (name, counts.tolist(), (probs * counts.sum()).tolist())
    assert 0 < second_after_accept.sum() < DRAWS  # both branches were taken


# A draft model's distributions for two drafts (rows sum to 1): close to the targets, not equal to them.
DRAFT_Q = torch.tensor([[0.30, 0.10, 0.05, 0.30, 0.15, 0.10],
                        [0.10, 0.35, 0.05, 0.05, 0.30, 0.15]])


@pytest.mark.parametrize("name", PARAMS)
def test_drafts_drawn_from_a_draft_distribution_keep_the_target_distribution(name):
    """Drafts drawn from q (a draft model's), accepted with probability min(1, p / q), the residual
    max(0, p - q) drawn on a rejection: the emitted tokens follow p, and the acceptance rate is the
    sum of min(p, q) (with the point-guess rule it would be sum(p * q), far lower here)."""
    params, output = PARAMS[name], [1]
    first, second_after_accept, accepted_first = torch.zeros(6), torch.zeros(6), 0
    for trial in range(DRAWS):
        drafting = torch.Generator().manual_seed(10_000 + trial)
        drafts = [int(torch.multinomial(DRAFT_Q[0], 1, generator=drafting))]
        drafts.append(int(torch.multinomial(DRAFT_Q[1], 1, generator=drafting)))
        seq = make_seq(params, drafts, output, seed=trial)
        seq.spec_draft_probs = DRAFT_Q.clone()
        result = verify(LOGITS, [seq])
        emitted = result.accepted[0] + [result.token_ids[0]]
        first[emitted[0]] += 1
        if result.accepted[0]:
            accepted_first += 1
            second_after_accept[emitted[1]] += 1
    tokens = PROMPT + output
    p0 = reference_target(LOGITS[0], params, tokens, output)
    statistic, df = chi_square(first, p0)
    assert statistic < CHI2_CRITICAL_001[df], (name, first.tolist(), (p0 * DRAWS).tolist())
    # After an accepted first draft the second row's target depends on which draft it was (penalties):
    # with temperature alone it does not, and the second token follows row 1's target too.
    if name == "temperature":
        p1 = reference_target(LOGITS[1], params, tokens, output)
        statistic, df = chi_square(second_after_accept, p1)
        assert statistic < CHI2_CRITICAL_001[df], (second_after_accept.tolist(), (p1 * accepted_first).tolist())
        want = float(torch.minimum(p0, DRAFT_Q[0]).sum())
        assert abs(accepted_first / DRAWS - want) < 0.03, (accepted_first / DRAWS, want)
        assert want > float((p0 * DRAFT_Q[0]).sum()) + 0.3  # the two rules are far apart here


def test_a_draft_the_filters_remove_is_never_accepted():
    params = SamplingParams(temperature=1.0, top_k=2)  # row 0 keeps tokens 0 and 3
    for trial in range(200):
        result = verify(LOGITS, [make_seq(params, [5, 1], seed=trial)])
        assert result.accepted[0] == [] and result.token_ids[0] in (0, 3)


def test_greedy_verification_keeps_the_agreeing_prefix_and_corrects_the_rest():
    params = SamplingParams(temperature=0, logprobs=1)
    agreeing = verify(LOGITS, [make_seq(params, [0, 1])])  # argmaxes of the rows: 0, 1, 2
    assert (agreeing.accepted[0], agreeing.token_ids[0]) == ([0, 1], 2)
    corrected = verify(LOGITS, [make_seq(params, [0, 4])])
    assert (corrected.accepted[0], corrected.token_ids[0]) == ([0], 1)
    logprobs = torch.log_softmax(LOGITS, dim=-1)
    assert corrected.accepted_logprobs[0][0][0] == pytest.approx(float(logprobs[0, 0]))
    assert corrected.logprobs[0][0] == pytest.approx(float(logprobs[1, 1]))


def test_sequences_without_drafts_sample_as_the_normal_sampler_does():
    from kubeinfer.engine.model_executor.sampler import sample

    params = SamplingParams(temperature=0.9, seed=5)
    alone = sample(LOGITS[:1], [make_seq(params, [], seed=11)]).token_ids
    mixed = verify(torch.cat([LOGITS, LOGITS[:1]]), [make_seq(params, [3, 4], seed=1), make_seq(params, [], seed=11)])
    assert mixed.token_ids[1] == alone[0] and mixed.accepted[1] == []


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),  # the 3-gram [1 2 3] seen before: what followed it
    ([1, 2, 3, 9, 8, 5, 2, 3], 2, [9, 8]),  # no 3-gram match; the 2-gram [2 3]
    ([4, 5, 6, 7], 3, []),  # nothing repeats
    ([7, 7, 7, 7, 7], 3, [7, 7]),  # a run: the earliest match, whose continuation is the longest
    ([1, 2, 5, 1, 2, 6, 1, 2], 1, [6]),  # the most recent match wins
])
def test_ngram_proposer(tokens, k, expected):
    assert NgramProposer(min_n=2, max_n=3).propose(tokens, k) == expected


def test_config_defaults_and_vllm_spellings():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_max, config.prompt_lookup_min, config.disable_by_batch_size) == (4, 2, None)
    assert SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 1}) \
        == SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=1, prompt_lookup_min=1)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse({}) is None


def test_ngram_index_grows_with_the_sequence_and_proposes_what_a_full_scan_would():
    """The proposer keeps an index per sequence and extends it by the tokens added since its last call;
    every proposal must equal a scan of the whole sequence from scratch (written here in plain Python)."""
    import random

    def scan(tokens, k, min_n=2, max_n=4):
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
            if starts:
                full = [s for s in starts if s + n + k <= len(tokens)]
                begin = (full[-1] if full else starts[0]) + n
                return tokens[begin:begin + k]
        return []

    class Owner:  # stands for a Sequence: weakly referenced, identity-hashed
        pass

    rng = random.Random(0)
    proposer, owner, tokens = NgramProposer(min_n=2, max_n=4), Owner(), []
    for _ in range(400):
        tokens.extend(rng.choice([1, 2, 3]) for _ in range(rng.randint(1, 5)))  # 1 token, or accepted drafts
        k = rng.randint(1, 5)
        assert proposer.propose(tokens, k, owner=owner) == scan(tokens, k)
    assert len(proposer._indexes) == 1
    del owner
    assert len(proposer._indexes) == 0  # a finished sequence takes its index with it
