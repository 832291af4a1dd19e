"""Draft-model speculation: a smaller model with the target's tokenizer proposes the next k tokens, one
forward pass per token over all the step's speculating sequences; the target checks them in one pass.
The draft proposes greedily, so its distribution q is one-hot at each draft (as for n-gram drafts) and
rejection_sampler keeps the target's distribution exactly, whatever the draft proposes.

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
from ..sequence import ScheduledBatch, Sequence

PLACEHOLDER = 0  # a draft not proposed yet; `fill` replaces it before the forward pass


@dataclass
class _Progress:
    computed: int = 0  # the sequence's leading tokens whose draft K/V are in the draft cache
    preemptions: int = 0  # the sequence's num_preemptions when they were computed


class DraftModel:
    def __init__(self, runner: ModelRunner, target_vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = min(target_vocab_size, runner.spec.vocab_size)  # drafts are target token ids
        self._progress: weakref.WeakKeyDictionary[Sequence, _Progress] = weakref.WeakKeyDictionary()

    @torch.inference_mode()
    def fill(self, batch: ScheduledBatch) -> None:
        """Replace the placeholder drafts of the batch's sequences with the draft model's greedy guesses."""
        seqs = [seq for seq, _ in batch.entries if seq.spec_token_ids]
        if not seqs:
            return
        starts = {seq: min(self.computed(seq), seq.num_tokens - 1) for seq in seqs}
        # First pass: each sequence's tokens the draft has not seen, up to its last (one-token spans first,
        # as the attention metadata wants decodes first); its logits give the first draft.
        seqs.sort(key=lambda s: s.num_tokens - starts[s] > 1)
        spans = [(seq, starts[seq], seq.token_ids[starts[seq]:]) for seq in seqs]
        for position in range(max(len(seq.spec_token_ids) for seq in seqs)):
            for (seq, _, _), token in zip(spans, self._next_tokens(spans)):
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

    def _next_tokens(self, spans: list[tuple[Sequence, int, list[int]]]) -> list[int]:
        inputs = StepInputs()
        for seq, start, tokens in spans:
            inputs.add(tokens, start, seq.block_table, self.runner.block_size)
            inputs.logits_indices.append(inputs.query_start_loc[-1] - 1)
            inputs.num_decodes += len(tokens) == 1
        logits = self.runner.forward(inputs)
        return logits[:, :self.vocab_size].argmax(dim=-1).tolist()
