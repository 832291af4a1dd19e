"""KV blocks of sliding-window layers, freed once they fall out of every window (issue 28).

On a model that mixes windowed and full-attention layers (Gemma 2 and 3, Qwen with max_window_layers), the
windowed layers keep their K/V in a pool of their own, with a block table of their own per sequence
(`WindowTable`, at `seq.window_blocks`). A future query at position p >= num_computed_tokens sees keys
after p - window, so once a block lies wholly before num_computed_tokens - window + 1 no layer of the group
reads it again: its entry becomes NULL_BLOCK (never handed out, never read unmasked) and the block goes
back to the pool, still keyed in the prefix cache until evicted. A long request thus holds, in that pool,
about window / block_size + 1 blocks instead of one per block of context.

Prefix caching: both pools key blocks by the same chained hashes. A cached prefix of k blocks is usable
only where the window pool still holds the blocks the next query will read (those covering the last
window - 1 tokens before it); the longest such k is taken, the full pool's extra hits are given back.
`HybridBlockManager` offers the scheduler BlockManager's interface over both pools; the figures the engine
reports (free blocks, usage, prefix hits) are the full-attention pool's, usage the fuller of the two.
"""
from __future__ import annotations

from ..sequence import Sequence
from .block_manager import BlockManager

NULL_BLOCK = 0  # stands for a freed block in a window table; block 0 of the window pool is never handed out


class WindowTable:
    """The window group's view of one sequence: its own table and hashes; everything else is the sequence's."""
    __slots__ = ("seq", "block_table", "block_hashes", "num_hashed_blocks", "num_released")

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_hashed_blocks = 0
        self.num_released = 0  # leading entries already checked for release

    def __getattr__(self, name: str):
        return getattr(self.seq, name)


class HybridBlockManager:
    def __init__(self, num_blocks: int, num_window_blocks: int, block_size: int, window: int,
                 enable_prefix_caching: bool = True) -> None:
        self.full = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.windowed = BlockManager(num_window_blocks + 1, block_size, enable_prefix_caching)
        del self.windowed.free_uncached[NULL_BLOCK]
        self.windowed.blocks[NULL_BLOCK].ref_count = 1
        self.window = window

    # -- what the engine reads ----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def block_size(self) -> int:
        return self.full.block_size

    @property
    def enable_prefix_caching(self) -> bool:
        return self.full.enable_prefix_caching

    @property
    def events(self):
        return self.full.events

    @events.setter
    def events(self, recorder) -> None:
        # KV events report the full-attention pool only: a subscriber routes on the longest prefix held, and
        # the full pool's cached blocks are the prefix; window blocks of the same keys are a subset of no use
        # without them (a hit needs both, and the full pool's eviction already ends it).
        self.full.events = recorder
    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    @property
    def num_free_window_blocks(self) -> int:
        return self.windowed.num_free_blocks

    @property
    def usage(self) -> float:
        window_usage = 1.0 - self.windowed.num_free_blocks / (self.windowed.num_blocks - 1)
        return max(self.full.usage, window_usage)

    @property
    def prefix_hits(self) -> int:
        return self.full.prefix_hits

    @property
    def prefix_queries(self) -> int:
        return self.full.prefix_queries

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return self.full.blocks_needed(seq, num_new_tokens)

    # -- the scheduler's operations ------------------------------------------------------------------
    def allocate_cached_prefix(self, seq: Sequence) -> int:
        num_cached = self.full.allocate_cached_prefix(seq)
        view = seq.window_blocks = WindowTable(seq)
        if not num_cached:
            return 0
        bs, hashes = self.block_size, seq.block_hashes
        usable = len(hashes)
        held = self.windowed.hash_to_block
        while usable and not all(h in held for h in hashes[self._first_read(usable * bs):usable]):
            usable -= 1
        self._give_back_full(seq, usable)
        first = self._first_read(usable * bs)
        view.block_table = [NULL_BLOCK] * first
        for h in hashes[first:usable]:
            block_id = self.windowed.hash_to_block[h]
            self.windowed._reuse_cached_block(block_id)
            view.block_table.append(block_id)
        view.block_hashes, view.num_hashed_blocks, view.num_released = list(hashes), usable, first
        if seq.num_preemptions == 0:
            self.full.prefix_hits -= num_cached - usable * bs
        return usable * bs

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        view = seq.window_blocks
        if self.windowed.blocks_needed(view, num_new_tokens) > self.windowed.num_free_blocks:
            return False
        if not self.full.allocate_slots(seq, num_new_tokens):
            return False
        return self.windowed.allocate_slots(view, num_new_tokens)

    def free(self, seq: Sequence) -> None:
        self.full.free(seq)
        view = seq.window_blocks
        if view is not None:
            view.block_table = [b for b in view.block_table if b != NULL_BLOCK]
            self.windowed.free(view)
            seq.window_blocks = None

    def free_tail(self, seq: Sequence) -> None:
        self.full.free_tail(seq)
        self.windowed.free_tail(seq.window_blocks)

    def commit_computed_blocks(self, seq: Sequence) -> None:
        """Register full blocks in both pools, then release the window blocks no later query reads."""
        self.full.commit_computed_blocks(seq)
        view = seq.window_blocks
        self.windowed.commit_computed_blocks(view)
        limit = self._first_read(seq.num_computed_tokens)
        if self.enable_prefix_caching:
            limit = min(limit, view.num_hashed_blocks)  # registered first: a freed block stays findable
        for i in range(view.num_released, limit):
            if view.block_table[i] != NULL_BLOCK:
                self._release(view.block_table[i])
                view.block_table[i] = NULL_BLOCK
        view.num_released = max(view.num_released, limit)

    def reset_prefix_cache(self) -> None:
        self.full.reset_prefix_cache()
        self.windowed.reset_prefix_cache()

    # -- helpers -----------------------------------------------------------------------------------------
    def _first_read(self, position: int) -> int:
        """The first block a query at `position` (or later) can read: the one holding position - window + 1."""
        return max(0, position - self.window + 1) // self.block_size

    def _release(self, block_id: int) -> None:
        pool = self.windowed
        block = pool.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None and pool.hash_to_block.get(block.block_hash) == block_id:
                pool.free_cached[block_id] = None
            else:
                block.block_hash = None
                pool.free_uncached[block_id] = None

    def _give_back_full(self, seq: Sequence, keep: int) -> None:
        """Drop the full pool's prefix hits beyond `keep` blocks (their window blocks are gone)."""
        pool = self.full
        while len(seq.block_table) > keep:
            block = pool.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                pool.free_cached[block.block_id] = None  # a prefix hit is registered: back to the cache
        del seq.block_hashes[keep:]
        seq.num_hashed_blocks = keep
