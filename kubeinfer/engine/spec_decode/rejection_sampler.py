"""Verification of draft tokens against the target model, one forward pass for all of them.

A sequence with k drafts d1..dk has k + 1 logits rows: row j is the target's next-token distribution after
the known tokens and d1..dj. Each row is processed exactly as the sampler processes a normal step (its
penalties and min_tokens see the drafts before it as already generated), then:

- greedy: d(j+1) is accepted while it equals row j's argmax; the first mismatch is replaced by that argmax;
  if all k pass, row k's argmax is a free extra token. The output is what non-speculative greedy gives.
- sampling: the rule of Leviathan et al. / Chen et al.: d, drawn from q, is accepted with probability
  min(1, p(d) / q(d)); on a rejection the next token is drawn from the residual max(0, p - q), normalised.
  Each emitted token is then distributed as p exactly, whatever q is. A draft model that samples its
  drafts passes its q (`Sequence.spec_draft_probs`); a point guess (n-gram, greedy drafts) is q = 1{d}:
  d is accepted with probability p(d), and the residual is p without d. All draws come from the sequence's
  own generator, so a seeded request is reproducible run to run (though not equal to its non-speculative
  output: the draws are consumed differently).

Sequences without drafts in the same step go through the normal sampler unchanged.
"""
from __future__ import annotations

import torch

from ..model_executor.sampler import (
    GrammarMasks,
    SampleResult,
    exponential_noise,
    logprob_entry,
    plain_greedy,
    process_logits,
    raw_logprobs_of,
    sample,
    target_probs,
)
from ..sequence import OutputTokens, Sequence


class DraftPrefix(OutputTokens):
    """A sequence as it would be after its first j drafts: what the sampler's rules read (penalties,
    min_tokens) when they judge row j."""
    grammar = None  # sequences with a grammar never speculate

    def __init__(self, seq: Sequence, j: int) -> None:
        self.params, self.generator = seq.params, seq.generator
        self.token_ids = seq.token_ids + seq.spec_token_ids[:j]
        self.num_prompt_tokens = seq.num_prompt_tokens


def verify(logits: torch.Tensor, seqs: list[Sequence], grammar_masks: GrammarMasks | None = None) -> SampleResult:
    """`logits` holds 1 + len(seq.spec_token_ids) rows per sequence, in order. Returns each sequence's sampled
    token (a correction, or the extra token after all drafts) and its accepted drafts, with logprobs."""
    starts, row = [], 0
    for seq in seqs:
        starts.append(row)
        row += 1 + len(seq.spec_token_ids)
    result = SampleResult([0] * len(seqs), [None] * len(seqs), [[] for _ in seqs], [[] for _ in seqs])
    if all(plain_greedy(seq) for seq in seqs):  # the common case: one argmax over every row, one host copy
        targets = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            _accept_greedy(targets[starts[i]:starts[i] + 1 + len(seq.spec_token_ids)], seq, result, i)
        return result
    plain = [i for i, seq in enumerate(seqs) if not seq.spec_token_ids]
    if plain:
        position = {i: r for r, i in enumerate(plain)}  # grammar masks index seqs; only plain ones have grammars
        masks = GrammarMasks([position[i] for i in grammar_masks.rows], grammar_masks.bitmask) if grammar_masks else None
        out = sample(logits[torch.tensor([starts[i] for i in plain], device=logits.device)], [seqs[i] for i in plain],
                     masks)
        for r, i in enumerate(plain):
            result.token_ids[i], result.logprobs[i] = out.token_ids[r], out.logprobs[r]
    for i, seq in enumerate(seqs):
        if seq.spec_token_ids:
            rows = logits[starts[i]:starts[i] + 1 + len(seq.spec_token_ids)]
            _verify_one(rows, seq, result, i)
    return result


def _accept_greedy(targets: list[int], seq: Sequence, result: SampleResult, i: int) -> None:
    """A plain greedy sequence (no rule changes its logits, no logprobs): its rows' raw argmaxes decide."""
    drafts = seq.spec_token_ids
    num_accepted = _agreeing_prefix(drafts, targets)
    result.accepted[i], result.accepted_logprobs[i] = drafts[:num_accepted], [None] * num_accepted
    result.token_ids[i] = targets[num_accepted]


def _agreeing_prefix(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the argmax of the row before them (greedy acceptance)."""
    return next((j for j, d in enumerate(drafts) if d != targets[j]), len(drafts))


def _verify_one(rows: torch.Tensor, seq: Sequence, result: SampleResult, i: int) -> None:
    drafts = seq.spec_token_ids
    views = [DraftPrefix(seq, j) for j in range(len(drafts) + 1)]
    processed = process_logits(rows, views)
    if seq.params.greedy:
        targets = processed.argmax(dim=-1).tolist()
        num_accepted = _agreeing_prefix(drafts, targets)
        token = targets[num_accepted]
    else:
        q = seq.spec_draft_probs  # a draft model's q, when it sampled these very drafts
        q = q if q is not None and len(q) == len(drafts) else None
        num_accepted, token = _accept_by_probability(target_probs(processed, views), drafts, seq.generator, q)
    raw = raw_logprobs_of(rows.float(), views)
    num_top = seq.params.logprobs
    emitted = drafts[:num_accepted] + [token]
    entries = [logprob_entry(raw[j], t, num_top) if raw is not None else None for j, t in enumerate(emitted)]
    result.accepted[i], result.accepted_logprobs[i] = drafts[:num_accepted], entries[:-1]
    result.token_ids[i], result.logprobs[i] = token, entries[-1]


def _accept_by_probability(probs: torch.Tensor, drafts: list[int], generator: torch.Generator,
                           q: torch.Tensor | None = None) -> tuple[int, int]:
    """(drafts accepted, the token after them). `probs`: the k + 1 target rows, filtered but unnormalised;
    `q`: the k rows the drafts were drawn from (normalised), or None for point guesses (q = 1{d})."""
    device = probs.device
    probs = probs / probs.sum(dim=-1, keepdim=True)
    rows = torch.arange(len(drafts), device=device)
    draft_ids = torch.tensor(drafts, device=device)
    p_draft = probs[rows, draft_ids]
    uniform = torch.rand(len(drafts), generator=generator, device=device)
    if q is not None:
        q = q.to(device=device, dtype=probs.dtype)
        q_draft = q[rows, draft_ids]
        if not bool((q_draft > 0).all()):  # not drawn from these rows after all: judge them as point guesses
            q = None
    if q is None:
        rejected = (uniform >= p_draft).tolist()  # u < p(d): accepted with probability p(d)
    else:
        rejected = (uniform * q_draft >= p_draft).tolist()  # u < p(d) / q(d)
    num_accepted = rejected.index(True) if True in rejected else len(drafts)
    target = probs[num_accepted].clone()
    if num_accepted < len(drafts):  # the residual max(0, p - q), drawn from (an exponential race needs no norm)
        if q is None:
            target[drafts[num_accepted]] = 0.0
        else:
            residual = (target - q[num_accepted]).clamp_(min=0.0)
            target = residual if bool(residual.sum() > 0) else target  # p == q up to rounding: p itself
    token = int((target / exponential_noise(target.shape[0], generator, device)).argmax())
    return num_accepted, token
