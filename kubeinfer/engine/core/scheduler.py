"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a token budget. Running sequences are served first (a decode needs one token, a
partly-prefilled prompt its next chunk), then waiting ones are admitted in (priority, arrival)
order while the budget, `max_num_seqs` and free KV blocks allow. When blocks run out, the
lowest-priority, most recent running sequence is preempted by recompute: its blocks are freed and it
goes back to the waiting queue, to be prefilled again (cheaply, if its prefix is still cached).
Under the "priority" policy a full batch also makes room the same way for a waiting sequence of
strictly higher priority.

With LoRA, a running sequence pins its adapter in a device slot. A waiting sequence whose adapter
cannot get a slot (all pinned) is passed over, keeping its place in the queue, so requests for
adapters that are on the device still run; it is admitted as soon as a slot frees. So is one whose
adapter was dropped from host memory while a reader (`on_adapter_missing`) fetches it off this thread.

Admission is exception-safe: whatever raises while one sequence is admitted (its adapter cannot be
read, a block cannot be written) finishes that sequence with the error and frees what it held; the
others go on. `policy` is vLLM's `--scheduling-policy`: "fcfs" orders by arrival alone, "priority"
by (priority, arrival).
"""
from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from ..lora.pool import LoRAPool
from ..sequence import ScheduledBatch, Sequence, SequenceStatus
from .block_manager import BlockManager


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"  # or "priority"

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, lora_pool: LoRAPool | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.lora_pool = lora_pool
        self.waiting: list[Sequence] = []  # sorted by _key
        self.running: list[Sequence] = []  # sorted by _key
        self.num_preemptions = 0
        self._key: Callable[[Sequence], tuple] = ((lambda s: s.schedule_key) if config.policy == "priority"
                                                  else (lambda s: (s.arrival_order,)))
        self._pinned: set[Sequence] = set()  # sequences holding a pin on their adapter's device slot
        # Set by a front end that can read adapter files off the engine thread: called with the id of an
        # adapter that is registered but no longer in host memory, it starts reading it and returns True.
        self.on_adapter_missing: Callable[[int], bool] | None = None
        # An external KV tier (kv_transfer/): on admission, the tokens it holds past the device-cached prefix
        # are allocated and counted as computed; the engine loads them before the forward.
        self.kv_connector = None

    # -- queue management ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> list[Sequence]:
        """Remove every sequence of a request, freeing its blocks. Returns what was removed."""
        removed = [s for s in self.waiting + self.running if s.request_id == request_id]
        for seq in removed:
            self.finish(seq, "abort")
        return removed

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a sequence wherever it is (running, waiting or between the two) and free all it holds."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release_adapter(seq)
        if self.kv_connector is not None:  # a connector that saves finished requests' blocks (not the CPU tier's)
            self.kv_connector.request_finished(seq, seq.block_table)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        seq.error = seq.error or error

    def fail_adapter(self, lora_id: int, error: str) -> list[Sequence]:
        """Finish the waiting sequences of an adapter that could not be read; returns them."""
        failed = [s for s in self.waiting if s.lora_id == lora_id]
        for seq in failed:
            self.finish(seq, "abort", error)
        return failed

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_adapter(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
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
            del seq.spec_token_ids[max(0, budget - 1):]  # drafts that do not fit the budget are dropped
            num_new = min(seq.num_tokens - seq.num_computed_tokens + len(seq.spec_token_ids), budget)
            while not bm.allocate_slots(seq, num_new):
                if seq.spec_token_ids:  # drop the drafts before preempting anyone for them
                    num_new -= len(seq.spec_token_ids)
                    seq.spec_token_ids = []
                    continue
                victim = self.running[-1]  # lowest priority, most recent: never one already scheduled
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.entries.append((seq, num_new))
                budget -= num_new
                index += 1

        # Admitting new work while we had to preempt for blocks would only thrash.
        out_of_blocks = bool(batch.preempted)
        if self.config.policy == "priority" and not out_of_blocks:
            budget += self._make_room_for_priority(batch)
        passed_over: list[Sequence] = []  # their adapter has no free slot, or is being read, now
        while (self.waiting and not out_of_blocks and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting.pop(0)
            if not self._adapter_ready(seq):
                passed_over.append(seq)
                continue
            try:
                num_new = self._admit(seq, budget)
            except Exception as error:  # this sequence's fault (its adapter, its blocks): end it alone
                self.finish(seq, "abort", f"{type(error).__name__}: {error}")
                batch.failed.append(seq)
                continue
            if num_new is None:  # not enough free blocks: it keeps its place, retried next step
                passed_over.append(seq)
                break
            batch.entries.append((seq, num_new))
            budget -= num_new
        for seq in passed_over:
            bisect.insort(self.waiting, seq, key=self._key)

        # Decodes first: the attention backend batches them together; then tokens with drafts to verify (the model
        # runner may run them as decodes too: they must follow the decodes). Then by adapter, so that each
        # adapter's tokens are one contiguous run and its LoRA delta works on a view, not a gather.
        batch.entries.sort(key=lambda e: (not ScheduledBatch.is_decode(*e), not e[0].spec_token_ids, e[0].lora_id))
        return batch

    def _make_room_for_priority(self, batch: ScheduledBatch) -> int:
        """With the batch full (max_num_seqs), a waiting sequence of strictly higher priority takes the
        place of the lowest-priority, most recent running one, which is preempted by recompute (as vLLM's
        priority policy does). Equal priorities never preempt each other. Returns the step's token budget
        the preempted ones gave back."""
        freed = 0
        while (self.waiting and self.running and len(self.running) >= self.config.max_num_seqs
               and self.waiting[0].priority < self.running[-1].priority):
            victim = self.running[-1]
            for entry in [e for e in batch.entries if e[0] is victim]:
                batch.entries.remove(entry)
                freed += entry[1]
            self._preempt(victim)
            batch.preempted.append(victim)
        return freed

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Pin the adapter, attach the cached prefix and allocate the step's slots; the number of tokens
        to compute, or None (everything given back) when the blocks are not there."""
        bm = self.block_manager
        self._acquire_adapter(seq)
        external = 0
        if not seq.block_table:
            cached = bm.allocate_cached_prefix(seq)
            if self.kv_connector is not None:
                external, _ = self.kv_connector.get_num_new_matched_tokens(seq, cached)
            seq.num_computed_tokens = cached + external
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached + external
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if not bm.allocate_slots(seq, num_new):
            bm.free(seq)  # give the cached prefix back
            seq.num_computed_tokens = 0
            self._release_adapter(seq)
            return None
        if self.kv_connector is not None:
            first = (seq.num_computed_tokens - external) // bm.block_size
            self.kv_connector.update_state_after_alloc(seq, seq.block_table[first:first + external // bm.block_size],
                                                       external)
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=self._key)
        return num_new

    # -- LoRA adapters --------------------------------------------------------------------------
    def _adapter_ready(self, seq: Sequence) -> bool:
        """Whether the sequence's adapter can be pinned now without reading files on this thread."""
        if not seq.lora_id or self.lora_pool is None:
            return True
        if not self.lora_pool.can_activate(seq.lora_id):
            return False  # every slot is pinned: wait for one
        missing = not self.lora_pool.has(seq.lora_id) and self.on_adapter_missing is not None
        return not (missing and self.on_adapter_missing(seq.lora_id))  # being read: wait for it

    def _acquire_adapter(self, seq: Sequence) -> None:
        """Pin the sequence's adapter in a device slot; raises if it can no longer be read."""
        if seq.lora_id and self.lora_pool is not None and seq not in self._pinned:
            self.lora_pool.acquire(seq.lora_id)
            self._pinned.add(seq)

    def _release_adapter(self, seq: Sequence) -> None:
        if seq in self._pinned:
            self._pinned.discard(seq)
            self.lora_pool.release(seq.lora_id)

    def waiting_adapters(self) -> set[int]:
        return {s.lora_id for s in self.waiting if s.lora_id}

    def running_adapters(self) -> set[int]:
        return {s.lora_id for s in self.running if s.lora_id}

    def on_step_done(self, batch: ScheduledBatch) -> None:
        """Advance each scheduled sequence past the tokens just computed, and cache its full blocks. Draft
        tokens are not counted here: `accept_drafts` counts those the verification kept."""
        self.advance(batch)
        self.commit(batch)

    def advance(self, batch: ScheduledBatch) -> None:
        """Count the batch's tokens as computed (async scheduling does this as soon as the step is launched)."""
        for seq, num_new in batch.entries:
            if not seq.is_finished:  # (one ended while the step ran has no blocks left)
                seq.num_computed_tokens += num_new - len(seq.spec_token_ids)

    def commit(self, batch: ScheduledBatch) -> None:
        """Register the blocks the batch filled in the prefix cache (once their token ids are all known)."""
        for seq, _ in batch.entries:
            if not seq.is_finished:
                self.block_manager.commit_computed_blocks(seq)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After a verification step whose tokens were appended: the K/V of the accepted drafts is valid (it
        was computed on the right prefix), the rejected ones' blocks go back to the pool."""
        seq.spec_token_ids = []
        if seq.is_finished:
            return  # finish() freed everything
        seq.num_computed_tokens += num_accepted
        self.block_manager.commit_computed_blocks(seq)
        self.block_manager.free_tail(seq)
