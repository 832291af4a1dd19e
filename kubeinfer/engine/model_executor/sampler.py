"""Turns each sequence's next-token logits into a token, with its own sampling parameters.

Order: logprobs are taken from the raw model distribution (as in vLLM); then penalties, logit_bias,
allowed_token_ids, the min_tokens ban on stop tokens, the structured-output grammar's mask, greedy argmax
or temperature, top-k, top-p, min-p and a draw. The bias comes after the penalties so that +-100 means "always" / "never" whatever the
repetition penalty did; nothing after it can revive a token it masked. The draw
uses the sequence's own generator (exponential race: argmax(p / Exp(1)) samples from p), so a seeded
request gives the same tokens whatever else shares its batch.

Everything runs where the logits are: on a GPU only the chosen token ids (and the logprobs a request
asked for) cross to the host, not [batch, vocab] floats (128 MB a step at batch 256 and a 128k vocab).
Each sequence's generator lives on that device too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..device_copy import on_device
from ..sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class SampleResult:
    token_ids: list[int] | PendingTokens
    # per row: (logprob of the sampled token, its rank, top-N [(token, logprob)]) or None
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]
    # Speculative decoding: per row, the draft tokens accepted before token_ids[i], and their logprobs
    accepted: list[list[int]] | None = None
    accepted_logprobs: list[list] | None = None
    # The sampler queued the step without waiting for the device (`sample(defer_copy=True)` on sync-free rows):
    # the engine may then leave the text of these tokens for the next step, to do while that one runs.
    async_copy: bool = False
    device_ids: torch.Tensor | None = None  # the sampled ids where the logits are (async scheduling reads them)

    def wait(self) -> None:
        """Until the token ids are on the host (they may still be on their way from the device)."""
        if isinstance(self.token_ids, PendingTokens):
            self.token_ids = self.token_ids.tolist()

    def tokens(self, i: int) -> list[tuple[int, tuple | None]]:
        """Row i's new tokens in order, with their logprobs: accepted drafts (if any), then the sampled one."""
        self.wait()
        drafts = list(zip(self.accepted[i], self.accepted_logprobs[i])) if self.accepted else []
        return drafts + [(self.token_ids[i], self.logprobs[i])]


class PendingTokens:
    """Token ids on their way from a GPU: the copy to pinned host memory is queued behind the step's kernels,
    and `tolist` waits for it, so the host can do other work (the previous step's text) meanwhile."""

    def __init__(self, token_ids: torch.Tensor) -> None:
        self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
        self._host.copy_(token_ids, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def tolist(self) -> list[int]:
        self._copied.synchronize()
        return self._host.tolist()


def sample(logits: torch.Tensor, seqs: list[Sequence], grammar_masks: GrammarMasks | None = None,
           defer_copy: bool = False) -> SampleResult:
    """`grammar_masks`: the structured-output masks of `seqs`, when the caller computed them already
    (the model runner does, on another thread, while the forward pass runs). `defer_copy`: when every row is
    `sync_free`, return before the token ids reach the host (on a GPU: `SampleResult.wait` / `tokens` wait)."""
    async_copy = defer_copy and all(sync_free(seq) for seq in seqs)
    if all(plain_greedy(seq) for seq in seqs):  # the common decode: one argmax, one copy to the host
        return _result(logits.argmax(dim=-1), [None] * len(seqs), async_copy)
    logits = logits.float()
    device = logits.device
    raw_logprobs = raw_logprobs_of(logits, seqs)
    logits = process_logits(logits, seqs, grammar_masks)

    greedy = [s.params.greedy for s in seqs]
    token_ids = torch.empty(len(seqs), dtype=torch.long, device=device)
    if any(greedy):
        rows = on_device([i for i, g in enumerate(greedy) if g], torch.long, device)
        token_ids[rows] = logits[rows].argmax(dim=-1)
    random_rows = [i for i, g in enumerate(greedy) if not g]
    if random_rows:
        rows = on_device(random_rows, torch.long, device)
        probs = target_probs(logits[rows], [seqs[i] for i in random_rows])
        noise = torch.stack([exponential_noise(probs.shape[1], seqs[i].generator, device) for i in random_rows])
        token_ids[rows] = (probs / noise).argmax(dim=-1)

    if raw_logprobs is None:
        return _result(token_ids, [None] * len(seqs), async_copy)
    tokens = token_ids.tolist()  # the logprob entries need the chosen tokens on the host
    logprobs = [None] * len(seqs)
    for i, seq in enumerate(seqs):
        if seq.params.logprobs is not None:
            logprobs[i] = logprob_entry(raw_logprobs[i], tokens[i], seq.params.logprobs)
    return SampleResult(tokens, logprobs, device_ids=token_ids)


def plain_greedy(seq: Sequence) -> bool:
    """Greedy with no logprobs and no rule that could change a logit now: the raw argmax is its token."""
    return seq.params.greedy and sync_free(seq)


def sync_free(seq: Sequence) -> bool:
    """No logprobs and no rule that could change a logit now (penalties, bias, allowed ids, the min_tokens ban, a
    grammar): greedy or temperature / top-k / top-p / min-p, which `sample` queues without waiting for the device."""
    p = seq.params
    return (p.logprobs is None and seq.grammar is None and not p.uses_penalties and not p.logit_bias
            and not p.allowed_token_ids and seq.num_output_tokens >= p.min_tokens)


def _result(token_ids: torch.Tensor, logprobs: list, async_copy: bool) -> SampleResult:
    pending = async_copy and token_ids.is_cuda
    return SampleResult(PendingTokens(token_ids) if pending else token_ids.tolist(), logprobs, async_copy=async_copy,
                        device_ids=token_ids)


def process_logits(logits: torch.Tensor, seqs: list[Sequence], grammar_masks: GrammarMasks | None = None) -> torch.Tensor:
    """A copy of the fp32 logits with every per-request rule applied (penalties, bias, allowed ids, the
    min_tokens ban, grammars): what greedy takes the argmax of, and what temperature turns into a distribution.
    Shared with speculative decoding's verification, so that a draft is judged by the very same rules."""
    logits = logits.float().clone()
    _apply_penalties(logits, seqs)
    _apply_logit_bias(logits, seqs)
    _keep_only_allowed_tokens(logits, seqs)
    _ban_stop_tokens_before_min_tokens(logits, seqs)
    _apply_grammars(logits, grammar_masks or grammar_bitmask(seqs))
    return logits


def target_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The distribution a non-greedy row samples from, from processed logits: temperature, then top-k,
    top-p and min-p. Not renormalised after the filters (a draw by exponential race does not need it)."""
    temperature = on_device([s.params.temperature for s in seqs], torch.float32, logits.device).unsqueeze(1)
    return _filter(torch.softmax(logits / temperature, dim=-1), seqs)


def exponential_noise(vocab: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Exp(1) noise from the sequence's own generator: argmax(p / noise) is a draw from p (normalised or not)."""
    return torch.empty(vocab, device=device).exponential_(generator=generator)


def logprob_entry(row: torch.Tensor, token: int, num_top: int) -> tuple[float, int, list[tuple[int, float]]]:
    """(logprob of `token`, its rank from 1, the top `num_top` [(token, logprob)]) from one row of raw logprobs."""
    chosen = row[token]
    rank = int((row > chosen).sum().item()) + 1
    top = torch.topk(row, num_top) if num_top else None
    return float(chosen), rank, list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []


@dataclass
class GrammarMasks:
    rows: list[int]  # the sequences (rows of the logits) that have a grammar
    # [len(rows), ceil(tokens / 32)] int32 on the host: bit t % 32 of word t // 32 = token t. `tokens` is the
    # grammar's vocabulary, which may be wider or narrower than the logits (see _apply_grammars).
    bitmask: torch.Tensor


def grammar_bitmask(seqs: list[Sequence]) -> GrammarMasks | None:
    """Structured output: what each constrained sequence's grammar allows next, or None when none is
    constrained. Host work only (the matchers), so it can run while the device computes the logits.
    A matcher that raises allows nothing and is marked failed: its request alone ends with the error."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return None
    bitmask = torch.zeros((len(rows), (seqs[rows[0]].grammar.vocab_size + 31) // 32), dtype=torch.int32)
    for r, i in enumerate(rows):
        try:
            seqs[i].grammar.fill_bitmask(bitmask, r)
        except Exception as error:
            logger.exception("structured output: the mask of request %s failed", seqs[i].request_id)
            bitmask[r] = 0
            seqs[i].grammar.fail(f"the grammar's mask failed: {type(error).__name__}: {error}")
    return GrammarMasks(rows, bitmask)


def _apply_grammars(logits: torch.Tensor, masks: GrammarMasks | None) -> None:
    """Tokens a grammar does not allow get -inf. The bitmask is unpacked on the host to one byte per token
    and sent to the logits' device; rows without a grammar are not touched, so free requests pay nothing.
    A logits column past the mask (an id the grammar does not know) is banned, as llguidance's own
    apply_token_bitmask_inplace does; mask bits past the logits (ids the model cannot produce) are dropped."""
    if masks is None:
        return
    vocab = logits.shape[1]
    bits = np.unpackbits(masks.bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    if bits.shape[1] < vocab:
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    banned = torch.from_numpy(bits).to(logits.device) == 0
    if len(masks.rows) == logits.shape[0]:
        logits.masked_fill_(banned, float("-inf"))
    else:
        full = torch.zeros_like(logits, dtype=torch.bool)
        full[torch.tensor(masks.rows, device=logits.device)] = banned
        logits.masked_fill_(full, float("-inf"))


def raw_logprobs_of(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor | None:
    if all(s.params.logprobs is None for s in seqs):
        return None
    return torch.log_softmax(logits, dim=-1)


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition penalty (over prompt and output, as in HF/vLLM: positive logits divided, negative
    multiplied); frequency and presence penalties (OpenAI's, over output tokens only)."""
    vocab, device = logits.shape[1], logits.device
    for i, seq in enumerate(seqs):
        p = seq.params
        if not p.uses_penalties:
            continue
        output = torch.tensor(seq.output_token_ids, dtype=torch.long, device=device)
        output = output[output < vocab]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            all_tokens = torch.tensor(seq.token_ids, dtype=torch.long, device=device)
            seen[all_tokens[all_tokens < vocab]] = True
            row = logits[i]
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            logits[i] = torch.where(seen, penalized, row)
        if p.frequency_penalty or p.presence_penalty:
            counts = torch.bincount(output, minlength=vocab).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _per_request_tensors(params, name: str, build, vocab: int, device) -> tuple:
    """Tensors made from a request's lists once, on its first step, not at every token: kept on the params
    object (each request's own copy), keyed by what they depend on."""
    key = f"_{name}_tensors"
    cached = params.__dict__.get(key)
    if cached is None or cached[0] != (vocab, device):
        cached = params.__dict__[key] = ((vocab, device), build())
    return cached[1]


def _apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """OpenAI's logit_bias: each listed token's logit moves by its bias (greedy requests included)."""
    vocab, device = logits.shape[1], logits.device
    for i, seq in enumerate(seqs):
        bias = seq.params.logit_bias
        if not bias:
            continue

        def build(bias=bias):  # the engine refuses ids outside the vocabulary; never index out of bounds on a GPU
            ids = [t for t in bias if t < vocab]
            return (torch.tensor(ids, dtype=torch.long, device=device),
                    torch.tensor([bias[t] for t in ids], dtype=torch.float32, device=device))
        ids, values = _per_request_tensors(seq.params, "logit_bias", build, vocab, device)
        logits[i, ids] += values.to(logits.dtype)


def _keep_only_allowed_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """vLLM's allowed_token_ids: every other token's logit becomes -inf."""
    vocab, device = logits.shape[1], logits.device
    for i, seq in enumerate(seqs):
        allowed = seq.params.allowed_token_ids
        if not allowed:
            continue
        ids = _per_request_tensors(seq.params, "allowed_token_ids", lambda allowed=allowed: torch.tensor(
            sorted({t for t in allowed if t < vocab}), dtype=torch.long, device=device), vocab, device)
        kept = logits[i, ids]
        logits[i] = float("-inf")
        logits[i, ids] = kept


def _ban_stop_tokens_before_min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    for i, seq in enumerate(seqs):
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(p.eos_token_ids))
            banned = [t for t in banned if t < logits.shape[1]]
            if banned:
                logits[i, banned] = float("-inf")


def _filter(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Zero out tokens outside top-k, top-p (smallest set whose mass reaches p) and min-p."""
    if not any(s.params.uses_filters for s in seqs):
        return probs
    vocab, device = probs.shape[1], probs.device
    top_k = on_device([s.params.top_k if s.params.top_k > 0 else vocab for s in seqs], torch.long, device)
    top_p = on_device([s.params.top_p for s in seqs], probs.dtype, device)
    min_p = on_device([s.params.min_p for s in seqs], probs.dtype, device)

    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    keep = ranks < top_k.unsqueeze(1)
    # top-p over what top-k kept: a token stays if the mass before it is still below p
    kept_probs = sorted_probs * keep
    mass_before = kept_probs.cumsum(dim=-1) - kept_probs
    keep &= mass_before < top_p.unsqueeze(1) * kept_probs.sum(dim=-1, keepdim=True)
    keep &= sorted_probs >= min_p.unsqueeze(1) * sorted_probs[:, :1]
    keep[:, 0] = True  # the most likely token always survives
    mask = torch.zeros_like(keep).scatter_(1, order, keep)
    return probs * mask
