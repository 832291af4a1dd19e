"""Paged KV-cache bookkeeping: fixed-size blocks, per-sequence block tables, reference counts,
a free pool, and the prefix cache.

The prefix cache names each *full* block by a sha256 key chained over every token before it (and the
LoRA adapter), so two requests that share a prompt prefix share the physical blocks that hold it. A freed
block keeps its key and stays reusable until the pool runs out of never-cached blocks; only then is
the least recently freed cached block evicted.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable

from ..sequence import Sequence
from .kv_events import KVEventRecorder

ROOT_KEY = bytes(32)  # the "parent" of a prompt's first block


def hash_block(parent_key: bytes, token_ids: list[int], adapter: tuple[int, int] = (0, 0)) -> bytes:
    """The block's prefix-cache key: sha256 of (parent key, adapter, the block's tokens), as fixed-width
    int64s. Chaining through `parent_key` makes the key cover every earlier token, and sha256 makes equal
    keys mean equal contents, so a hit needs no token comparison. (Python's `hash` of a tuple could give
    two different prefixes one key, and serve one request another's KV.) `adapter` is the sequence's
    (lora_id, lora_generation): blocks computed with other adapter weights are never shared."""
    data = struct.pack(f"<{2 + len(token_ids)}q", *adapter, *token_ids)
    return hashlib.sha256(parent_key + data).digest()


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Never-cached free blocks in the order they are handed out (an ordered set: a sequence may ask for
        # the block after its last one, wherever that is in the order).
        self.free_uncached: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first
        self.hash_to_block: dict[bytes, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found
        # Where registrations, evictions and resets are reported (core/kv_events.py); None: KV events are off.
        self.events: KVEventRecorder | None = None
        # Told (block hash, block id) just before a cached block is handed out again: a KV connector's
        # chance to save it to its tier (kv_transfer/); None: evicted blocks are gone.
        self.on_evict: Callable[[bytes, int], None] | None = None

    @staticmethod
    def block_key(parent_key: bytes | None, token_ids: list[int], adapter: tuple[int, int]) -> bytes:
        """The prefix-cache key of a block after `parent_key` (None: the prompt's first block), for the layers
        that key blocks the same way without importing this one (kv_transfer/)."""
        return hash_block(parent_key or ROOT_KEY, token_ids, adapter)

    # -- pool state ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    # -- allocation ---------------------------------------------------------------------------
    def _take_free_block(self, preferred: int | None = None) -> int:
        """A free block: `preferred` if it is free and uncached, else the first uncached one, else the least
        recently freed cached one (evicted)."""
        if preferred in self.free_uncached:
            del self.free_uncached[preferred]
            block_id = preferred
        elif self.free_uncached:
            block_id, _ = self.free_uncached.popitem(last=False)
        else:  # evict the least recently freed cached block
            block_id, _ = self.free_cached.popitem(last=False)
            block = self.blocks[block_id]
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
                if self.on_evict is not None:
                    self.on_evict(block.block_hash, block_id)
            block.block_hash = None
        self.blocks[block_id].ref_count = 1
        return block_id

    def _reuse_cached_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_cached[block_id]
        block.ref_count += 1

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """On a sequence's first schedule (or after preemption), attach the cached blocks of its
        longest cached prefix. Returns the number of tokens found. At least the last token is always
        left to compute, since its logits are needed."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        seq.block_hashes = []
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        max_full_blocks = (seq.num_tokens - 1) // bs
        parent, adapter = ROOT_KEY, (seq.lora_id, seq.lora_generation)
        for i in range(max_full_blocks):
            h = hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs], adapter)
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            self._reuse_cached_block(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            parent = h
        seq.num_hashed_blocks = len(seq.block_table)
        num_cached = len(seq.block_table) * bs
        if seq.num_preemptions == 0:
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += num_cached
        return num_cached

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and nothing changed) if the pool is short."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        table = seq.block_table
        for _ in range(needed):
            # The block after the sequence's last when free: a context in consecutive blocks is a slice of
            # the cache, which the CPU attention reads without gathering it.
            table.append(self._take_free_block(table[-1] + 1 if table else None))
        return True

    def free(self, seq: Sequence) -> None:
        # Tail blocks are freed first so that they are evicted first: a prefix is worth more than its tail.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block_id:
                    self.free_cached[block_id] = None
                else:
                    block.block_hash = None
                    self.free_uncached[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0

    def free_tail(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's computed tokens: after speculative decoding they held
        only rejected draft tokens. Never hashed (only full computed blocks are), so they go back uncached,
        at the front of the pool, to be reused first."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                block.block_hash = None
                self.free_uncached[block.block_id] = None
                self.free_uncached.move_to_end(block.block_id, last=False)

    def commit_computed_blocks(self, seq: Sequence) -> None:
        """Register blocks that became full of computed tokens, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        adapter = (seq.lora_id, seq.lora_generation)
        while seq.num_hashed_blocks < num_full:
            i = seq.num_hashed_blocks
            parent = seq.block_hashes[i - 1] if i else ROOT_KEY
            h = hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs], adapter)
            block = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block:  # a twin computed concurrently keeps the first registration
                self.hash_to_block[h] = block.block_id
                block.block_hash = h
                if self.events is not None:
                    self.events.stored(h, parent if i else None, seq.token_ids[i * bs:(i + 1) * bs], seq.lora_id)
            seq.block_hashes.append(h)
            seq.num_hashed_blocks += 1

    def reset_prefix_cache(self) -> None:
        """Forget the cached blocks no sequence holds. Reported as vLLM's AllBlocksCleared when nothing stays
        cached; blocks of running sequences stay registered, so then only the forgotten keys are removed."""
        cleared = [self.blocks[block_id].block_hash for block_id in self.free_cached]
        for block_id in list(self.free_cached):
            block = self.blocks[block_id]
            block.block_hash = None
            self.free_uncached[block_id] = None
        self.free_cached.clear()
        self.hash_to_block = {h: b for h, b in self.hash_to_block.items() if self.blocks[b].ref_count > 0}
        if self.events is not None:
            if not self.hash_to_block:
                self.events.cleared()
            else:
                for block_hash in cleared:
                    self.events.removed(block_hash)
