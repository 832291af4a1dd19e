"""Draft-model speculation: a smaller model with the target's tokenizer proposes the next k tokens, one
forward pass per token over all the step's speculating sequences; the target checks them in one pass.
For a greedy request the draft proposes its argmax (q is one-hot, as for n-gram drafts); for a sampled
one it draws each draft from its own distribution q, processed by the request's sampling rules as the
target's rows are (temperature, top-k/p, min-p, penalties, bias), and records q for the acceptance rule
min(1, p / q). Either way rejection_sampler keeps the target's distribution exactly; a q close to p
accepts more (with greedy drafts a sampled request accepts a draft with probability p(d) only).

Its KV cache is its own tensors, paged by the target's block tables (same block size, same block ids):
a token sits at the same slot in both caches, so the draft needs no block manager, and the slots of
the drafts are allocated by the scheduler with the target's. Hence two phases: `propose` (speculator)
asks for k placeholder drafts before scheduling; `fill` runs the draft after it, on the slots given.
The draft keeps up lazily: it computes a sequence's tokens only when the sequence speculates, catching
up from where it stopped (its whole prompt the first time: the draft does not use the prefix cache);
a preemption starts it over. Draft K/V gone stale (a block reused meanwhile) can only lower the
acceptance, never change an output: the target verifies every draft.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..model_executor.model_runner import ModelRunner, StepInputs
from ..model_executor.sampler import exponential_noise, process_logits, target_probs
from ..sequence import ScheduledBatch, Sequence
from .rejection_sampler import DraftPrefix

PLACEHOLDER = 0  # a draft not proposed yet; `fill` replaces it before the forward pass


@dataclass
class _Progress:
    computed: int = 0  # the sequence's leading tokens whose draft K/V are in the draft cache
    preemptions: int = 0  # the sequence's num_preemptions when they were computed


class DraftModel:
    def __init__(self, runner: ModelRunner, target_vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = min(target_vocab_size, runner.spec.vocab_size)  # drafts are target token ids
        self.target_vocab_size = target_vocab_size
        self._progress: weakref.WeakKeyDictionary[Sequence, _Progress] = weakref.WeakKeyDictionary()

    @torch.inference_mode()
    def fill(self, batch: ScheduledBatch) -> None:
        """Replace the placeholder drafts of the batch's sequences with the draft model's guesses (and, for
        sampled requests, the distributions they were drawn from)."""
        seqs = [seq for seq, _ in batch.entries if seq.spec_token_ids]
        if not seqs:
            return
        starts = {seq: min(self.computed(seq), seq.num_tokens - 1) for seq in seqs}
        # First pass: each sequence's tokens the draft has not seen, up to its last (one-token spans first,
        # as the attention metadata wants decodes first); its logits give the first draft.
        seqs.sort(key=lambda s: s.num_tokens - starts[s] > 1)
        spans = [(seq, starts[seq], seq.token_ids[starts[seq]:]) for seq in seqs]
        for seq in seqs:
            if not seq.params.greedy:
                seq.spec_draft_probs = torch.zeros(len(seq.spec_token_ids), self.target_vocab_size,
                                                   device=self.runner.device)
        for position in range(max(len(seq.spec_token_ids) for seq in seqs)):
            for (seq, _, _), token in zip(spans, self._next_tokens(spans, position)):
                seq.spec_token_ids[position] = token
            # Then one pass per draft: the draft just made, at the position after the last token seen.
            spans = [(seq, seq.num_tokens + position, [seq.spec_token_ids[position]])
                     for seq in seqs if len(seq.spec_token_ids) > position + 1]
        for seq in seqs:  # the last draft was never fed back: its K/V are not in the cache
            self._progress[seq] = _Progress(seq.num_tokens + len(seq.spec_token_ids) - 1, seq.num_preemptions)

    def computed(self, seq: Sequence) -> int:
        """How many of the sequence's leading tokens the draft cache holds (rejected guesses included:
        the next pass starts at the sequence's last token at the latest, overwriting them)."""
        progress = self._progress.get(seq)
        return 0 if progress is None or progress.preemptions != seq.num_preemptions else progress.computed

    def _next_tokens(self, spans: list[tuple[Sequence, int, list[int]]], position: int) -> list[int]:
        """Each span's draft at `position`: the argmax for greedy requests, a draw from q for sampled ones."""
        inputs = StepInputs()
        for seq, start, tokens in spans:
            inputs.add(tokens, start, seq.block_table, self.runner.block_size)
            inputs.logits_indices.append(inputs.query_start_loc[-1] - 1)
            inputs.num_decodes += len(tokens) == 1
        logits = self.runner.forward(inputs)
        drafts = logits[:, :self.vocab_size].argmax(dim=-1).tolist()
        sampled = [i for i, (seq, _, _) in enumerate(spans) if not seq.params.greedy]
        if sampled:
            q = self._draft_probs(logits[sampled], [spans[i][0] for i in sampled], position)
            for row, i in enumerate(sampled):
                seq = spans[i][0]
                seq.spec_draft_probs[position] = q[row]
                drafts[i] = int((q[row] / exponential_noise(q.shape[1], seq.generator, q.device)).argmax())
        return drafts

    def _draft_probs(self, logits: torch.Tensor, seqs: list[Sequence], position: int) -> torch.Tensor:
        """q over the target's vocabulary (rows sum to 1): the draft's logits under each request's rules, as
        if its drafts before `position` were generated; ids the draft cannot produce get 0."""
        if logits.shape[1] != self.target_vocab_size:
            widened = logits.new_full((logits.shape[0], self.target_vocab_size), float("-inf"))
            widened[:, :self.vocab_size] = logits[:, :self.vocab_size]
            logits = widened
        views = [DraftPrefix(seq, position) for seq in seqs]
        q = target_probs(process_logits(logits, views), views)
        return q / q.sum(dim=-1, keepdim=True)
