"""The native CPU tier's storage: a host buffer of block slots and an LRU index keyed by prefix-cache hashes.

Each slot holds one device block across every offloaded layer, keys and values, contiguous
([layers, 2, block_size, kv_heads, head_dim]): a block moves as one large copy, not 2 x layers small ones
(vLLM's offloading layout change that gave ~10x its transfer throughput). On CUDA the buffer is pinned so
host<->device copies can be asynchronous. Keys are the block manager's sha256 chain (`hash_block`): the same
bytes in every process and after restarts (no Python `hash`), and they cover the LoRA adapter.

A slot matched by an admission, or with a transfer pending, is pinned until the step's transfers ran: LRU
eviction passes it over, so a save never overwrites a block a load of the same step still has to read (the
admission's own allocation evicts device blocks, which are saved) and a save's target is not reused twice.
"""
from __future__ import annotations

from collections import OrderedDict

import torch


class CPUBlockPool:
    def __init__(self, num_slots: int, slot_shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool) -> None:
        self.num_slots = num_slots
        self.buffer = torch.empty((num_slots, *slot_shape), dtype=dtype, pin_memory=pin_memory)
        self.slot_bytes = self.buffer[0].numel() * self.buffer.element_size()
        self.index: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, least recently used first
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.pinned: dict[int, int] = {}  # slot -> transfers pending on it this step

    def __len__(self) -> int:
        return len(self.index)

    def lookup(self, block_hash: bytes) -> int | None:
        return self.index.get(block_hash)

    def touch(self, block_hash: bytes) -> None:
        self.index.move_to_end(block_hash)

    def pin(self, slot: int) -> None:
        self.pinned[slot] = self.pinned.get(slot, 0) + 1

    def unpin_all(self) -> None:
        self.pinned.clear()

    def allocate(self, block_hash: bytes) -> int | None:
        """A slot to store `block_hash` in (pinned); None when it is already stored or every slot is pinned."""
        if block_hash in self.index:
            self.touch(block_hash)
            return None
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((h for h, s in self.index.items() if s not in self.pinned), None)
            if victim is None:
                return None
            slot = self.index.pop(victim)
        self.index[block_hash] = slot
        self.pin(slot)
        return slot

    def discard(self, block_hash: bytes) -> None:
        """Drop a block whose slot holds nothing valid (its save failed)."""
        slot = self.index.pop(block_hash, None)
        if slot is not None:
            self.free_slots.append(slot)

    def clear(self) -> None:
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.index.clear()
        self.pinned.clear()
