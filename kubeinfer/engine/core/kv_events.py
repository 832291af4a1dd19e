"""KV-cache events in vLLM's wire format, and the recorder the block manager reports to.

A subscriber (llm-d's KV-cache indexer, our gateway) follows which blocks each engine holds from three events:
`BlockStored` (a full block's prefix-cache key was registered), `BlockRemoved` (a key was evicted) and
`AllBlocksCleared` (the prefix cache was reset). They travel as msgspec structs encoded the way vLLM's
`vllm.distributed.kv_events` encodes them: positional msgpack arrays (`array_like`), events tagged by their
class name as the array's first item, an `EventBatch` of `[ts, events, data_parallel_rank]`.
Field order is the wire contract: never reorder, only append fields with defaults.

The block manager only appends events to a `KVEventRecorder` (a list append inside the step); the engine hands
each step's events to the publisher (kv_event_publisher.py), which encodes and sends them on its own thread.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # vLLM's name for the device tier, also used when the device is a CPU


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change to the set of cached blocks; the tag on the wire is the subclass's name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVEventRecorder:
    """Collects one step's events. `lora_name_of` names an adapter id (the engine's registry), so a stored
    block says which adapter's weights computed it, as vLLM's `lora_name` does."""

    def __init__(self, block_size: int, lora_name_of: Callable[[int], str | None] = lambda _id: None) -> None:
        self.block_size = block_size
        self.lora_name_of = lora_name_of
        self.pending: list[KVCacheEvent] = []

    def stored(self, block_hash: bytes, parent: bytes | None, token_ids: list[int], lora_id: int) -> None:
        # One event per block, as the block manager registers them one at a time; consecutive blocks of one
        # sequence registered in one step are merged into one event (its hashes chain in order).
        last = self.pending[-1] if self.pending else None
        if (isinstance(last, BlockStored) and last.block_hashes[-1] == parent and parent is not None
                and last.lora_id == (lora_id or None)):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            return
        self.pending.append(BlockStored([block_hash], parent, list(token_ids), self.block_size, lora_id or None,
                                        MEDIUM_GPU, self.lora_name_of(lora_id) if lora_id else None))

    def removed(self, block_hash: bytes) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.pending.append(BlockRemoved([block_hash], MEDIUM_GPU))

    def cleared(self) -> None:
        self.pending.append(AllBlocksCleared())

    def take_batch(self, data_parallel_rank: int = 0) -> KVEventBatch | None:
        """This step's events as one batch (None when nothing changed), and a fresh list for the next."""
        if not self.pending:
            return None
        events, self.pending = self.pending, []
        return KVEventBatch(ts=time.time(), events=events, data_parallel_rank=data_parallel_rank)
