"""Per step: which sequences speculate and with how many drafts, the verification, and the counters.

Speculation pays when the model is memory-bound (small batches) and the drafts are right; it costs when
neither holds. So it is off for the whole step once `disable_by_batch_size` requests are in the engine
(vLLM's switch), and off for one request for a while when its acceptance stays low: every
`acceptance_window` draft tokens its rate is checked, and below `min_acceptance_rate` it pauses for a
number of its own tokens that doubles each time (the text may turn copy-heavy later). At batch 1 it is also
off while its measured step costs say it loses (step_costs.py: a verify step's tokens/s against a plain step's).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from ..model_executor.model_runner import ModelRunner
from ..model_executor.sampler import GrammarMasks, SampleResult
from ..sequence import ScheduledBatch, Sequence
from . import rejection_sampler
from .config import SpeculativeConfig
from .draft_model import PLACEHOLDER, DraftModel
from .ngram import NgramProposer
from .step_costs import StepCosts

logger = logging.getLogger(__name__)

FIRST_PAUSE = 16  # tokens a request generates without speculation after its first low-acceptance window
MAX_PAUSE = 512


@dataclass
class Acceptance:
    """One request's recent record, for the adaptive switch."""
    drafted: int = 0
    accepted: int = 0
    resume_at: int = 0  # its number of output tokens from which it may speculate again
    pause: int = FIRST_PAUSE


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft_runner: ModelRunner | None = None,
                 vocab_size: int = 0) -> None:
        """`draft_runner`: the loaded draft model (method "draft_model"); `vocab_size`: the target's."""
        self.config = config
        self.max_model_len = max_model_len
        self.draft = DraftModel(draft_runner, vocab_size) if draft_runner is not None else None
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self._records: weakref.WeakKeyDictionary[Sequence, Acceptance] = weakref.WeakKeyDictionary()
        # vLLM's counters: verification steps with drafts, draft tokens verified, of those accepted (and by position)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens
        # The batch-1 switch (None: off; min_acceptance_rate 0 asks for speculation whatever it measures)
        self.costs: StepCosts | None = StepCosts() if config.min_acceptance_rate > 0 else None
        self._measured: Sequence | None = None  # the batch-1 step's sequence, whose step cost `step_done` records
        self._verified: int | None = None  # the tokens that step's verification produced

    def attach(self, runner: ModelRunner) -> None:
        """The model runner's hooks: drafts written after scheduling (draft model), and verification."""
        runner.verify_drafts = self.verify
        runner.fill_drafts = self.draft.fill if self.draft is not None else None
        if not runner.verify_as_decodes():
            logger.warning("speculative decoding: the verify step (1 + k tokens a sequence) runs as a chunk on the "
                           "generic attention path here, not on the native one-token decode path (that needs the CPU "
                           "with the native decode attention in every layer); at batch 1 the engine measures both "
                           "steps and speculates only while it pays")

    # -- before scheduling ----------------------------------------------------------------------------
    def propose(self, running: list[Sequence], num_waiting: int) -> None:
        """Set `spec_token_ids` on the running sequences that speculate this step (and clear the others)."""
        limit = self.config.disable_by_batch_size
        on = limit is None or len(running) + num_waiting < limit
        batch1 = len(running) == 1 and not num_waiting and running[0].num_tokens - running[0].num_computed_tokens == 1
        self._measured, self._verified = (running[0] if batch1 and self.costs is not None else None), None
        if self._measured is not None:
            on = on and self.costs.speculate()
        for seq in running:
            seq.spec_token_ids = self._drafts(seq) if on and self._may_speculate(seq) else []
            seq.spec_draft_probs = None  # a draft model sets it when it samples the drafts (DraftModel.fill)

    def _may_speculate(self, seq: Sequence) -> bool:
        """Decoding (one token left to compute), free of a grammar (the drafts would have to be checked
        against it token by token: not done), and not paused for low acceptance."""
        if seq.num_tokens - seq.num_computed_tokens != 1 or seq.grammar is not None:
            return False
        record = self._records.get(seq)
        return record is None or seq.num_output_tokens >= record.resume_at

    def _drafts(self, seq: Sequence) -> list[int]:
        # Never past max_tokens or the context: the accepted drafts plus one sampled token must fit both.
        room = min(self.config.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens - 1)
        if self.draft is not None:  # guessed once the scheduler has given their slots (DraftModel.fill)
            return [PLACEHOLDER] * max(0, room)
        return self.proposer.propose(seq.token_ids, room, owner=seq)

    # -- the step -------------------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, seqs: list[Sequence], grammar_masks: GrammarMasks | None) -> SampleResult:
        """The model runner's hook for steps with drafts: sample every sequence, and count."""
        result = rejection_sampler.verify(logits, seqs, grammar_masks)
        if self._measured is not None and len(seqs) == 1 and seqs[0] is self._measured:
            self._verified = 1 + len(result.accepted[0])
        for seq, accepted in zip(seqs, result.accepted):
            if seq.spec_token_ids:
                self._count(seq, len(seq.spec_token_ids), len(accepted))
        return result

    def step_done(self, batch: ScheduledBatch, seconds: float) -> None:
        """The engine's report of a step's wall time (propose to outputs): a batch-1 decode step's is measured."""
        if self._measured is not None and len(batch.entries) == 1 and batch.entries[0][0] is self._measured:
            self.costs.record(seconds, self._verified)
        self._measured = self._verified = None

    def _count(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1
        record = self._records.setdefault(seq, Acceptance())
        record.drafted += drafted
        record.accepted += accepted
        if record.drafted < self.config.acceptance_window:
            return
        if record.accepted < self.config.min_acceptance_rate * record.drafted:
            record.resume_at = seq.num_output_tokens + record.pause
            record.pause = min(2 * record.pause, MAX_PAUSE)
        else:
            record.pause = FIRST_PAUSE
        record.drafted = record.accepted = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
