"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a token budget. Running sequences are served first (a decode needs one token, a
partly-prefilled prompt its next chunk), then waiting ones are admitted in (priority, arrival)
order while the budget, `max_num_seqs` and free KV blocks allow. When blocks run out, the
lowest-priority, most recent running sequence is preempted by recompute: its blocks are freed and it
goes back to the waiting queue, to be prefilled again (cheaply, if its prefix is still cached).

With LoRA, a running sequence pins its adapter in a device slot. A waiting sequence whose adapter
cannot get a slot (all pinned) is passed over, keeping its place in the queue, so requests for
adapters that are on the device still run; it is admitted as soon as a slot frees.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..lora.adapter import LoRALoadError
from ..lora.pool import LoRAPool, LoRAPoolError
from ..sequence import ScheduledBatch, Sequence, SequenceStatus
from .block_manager import BlockManager


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, lora_pool: LoRAPool | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.lora_pool = lora_pool
        self.waiting: list[Sequence] = []  # sorted by schedule_key
        self.running: list[Sequence] = []  # sorted by schedule_key
        self.num_preemptions = 0

    # -- queue management ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.schedule_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> list[Sequence]:
        """Remove every sequence of a request, freeing its blocks. Returns what was removed."""
        removed = [s for s in self.waiting + self.running if s.request_id == request_id]
        for seq in removed:
            self.finish(seq, "abort")
        return removed

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self._release_adapter(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_adapter(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    # -- the step -----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.allocate_slots(seq, num_new):
                victim = self.running[-1]  # lowest priority, most recent: never one already scheduled
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.entries.append((seq, num_new))
                budget -= num_new
                index += 1

        # Admitting new work while we had to preempt would only thrash.
        passed_over: list[Sequence] = []  # their adapter has no free slot now
        while (self.waiting and not batch.preempted and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if not self._adapter_can_run(seq):
                passed_over.append(self.waiting.pop(0))
                continue
            if not seq.block_table:
                cached = bm.allocate_cached_prefix(seq)
                seq.num_computed_tokens = cached
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = cached
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not bm.allocate_slots(seq, num_new):
                bm.free(seq)  # give the cached prefix back; retry next step
                seq.num_computed_tokens = 0
                break
            self.waiting.pop(0)
            if not self._acquire_adapter(seq):
                batch.failed.append(seq)
                continue
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.schedule_key)
            batch.entries.append((seq, num_new))
            budget -= num_new
        for seq in passed_over:
            bisect.insort(self.waiting, seq, key=lambda s: s.schedule_key)

        # Decodes first: the attention backend batches them together. Then by adapter, so that each
        # adapter's tokens are one contiguous run and its LoRA delta works on a view, not a gather.
        batch.entries.sort(key=lambda e: (not ScheduledBatch.is_decode(*e), e[0].lora_id))
        return batch

    # -- LoRA adapters --------------------------------------------------------------------------
    def _adapter_can_run(self, seq: Sequence) -> bool:
        return not seq.lora_id or self.lora_pool is None or self.lora_pool.can_activate(seq.lora_id)

    def _acquire_adapter(self, seq: Sequence) -> bool:
        """Pin the sequence's adapter in a device slot. False (and the sequence finished with
        reason "abort") if the adapter can no longer be read, e.g. its files were removed."""
        if not seq.lora_id or self.lora_pool is None:
            return True
        try:
            self.lora_pool.acquire(seq.lora_id)
        except (LoRAPoolError, LoRALoadError) as error:
            seq.error = str(error)
            self.finish(seq, "abort")
            return False
        return True

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.lora_id and self.lora_pool is not None:
            self.lora_pool.release(seq.lora_id)

    def waiting_adapters(self) -> set[int]:
        return {s.lora_id for s in self.waiting if s.lora_id}

    def running_adapters(self) -> set[int]:
        return {s.lora_id for s in self.running if s.lora_id}

    def on_step_done(self, batch: ScheduledBatch) -> None:
        """Advance each scheduled sequence past the tokens just computed, and cache its full blocks."""
        for seq, num_new in batch.entries:
            seq.num_computed_tokens += num_new
            self.block_manager.commit_computed_blocks(seq)
