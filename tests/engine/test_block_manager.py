"""Paged KV bookkeeping and the prefix cache, without a model."""
import torch

from kubeinfer.engine.core.block_manager import ROOT_KEY, BlockManager, hash_block
from kubeinfer.engine.sampling_params import SamplingParams
from kubeinfer.engine.sequence import Sequence


def make_seq(tokens, lora_id=0, lora_generation=0):
    return Sequence("r", tokens, SamplingParams(), torch.Generator(), lora_id=lora_id, lora_generation=lora_generation)


def run_prefill(bm, seq):
    """What the scheduler does for a sequence's whole prompt in one step."""
    seq.num_computed_tokens = bm.allocate_cached_prefix(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_computed_blocks(seq)


def test_allocation_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    run_prefill(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert 0 < bm.usage < 1
    bm.free(seq)
    assert bm.num_free_blocks == 8 and bm.usage == 0


def test_allocation_fails_without_partial_effects():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(12)))
    assert not bm.allocate_slots(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_shared_prefix_reuses_full_blocks_and_counts_hits():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(10)))
    run_prefill(bm, a)
    b = make_seq(list(range(8)) + [99, 98, 97])
    run_prefill(bm, b)
    assert b.block_table[:2] == a.block_table[:2]  # two full blocks shared
    assert b.block_table[2] != a.block_table[2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.prefix_queries == 21 and bm.prefix_hits == 8


def test_last_token_is_never_a_cache_hit():
    bm = BlockManager(num_blocks=16, block_size=4)
    run_prefill(bm, make_seq(list(range(8))))
    again = make_seq(list(range(8)))
    assert bm.allocate_cached_prefix(again) == 4  # the second block holds the last token: recomputed


def test_lora_adapters_never_share_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    run_prefill(bm, make_seq(list(range(10)), lora_id=1))
    assert bm.allocate_cached_prefix(make_seq(list(range(10)), lora_id=2)) == 0
    assert bm.allocate_cached_prefix(make_seq(list(range(10)), lora_id=1)) == 8


def test_freed_cached_blocks_survive_until_the_pool_runs_out():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(list(range(8)) + [1])
    run_prefill(bm, a)
    bm.free(a)
    # One never-cached block is left plus 3 cached ones: a 1-block request must not evict.
    b = make_seq([50, 51])
    run_prefill(bm, b)
    assert bm.allocate_cached_prefix(make_seq(list(range(8)) + [7])) == 8
    # Now exhaust the pool: cached blocks are evicted, least recently freed first.
    bm2 = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(list(range(8)) + [1])
    run_prefill(bm2, a)
    bm2.free(a)
    c = make_seq(list(range(100, 108)) + [1])  # needs all 3 blocks
    run_prefill(bm2, c)
    assert bm2.hash_to_block and all(bm2.blocks[b].ref_count == 1 for b in c.block_table)
    assert bm2.allocate_cached_prefix(make_seq(list(range(8)) + [1])) == 0


def test_eviction_prefers_tail_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5, 6, 7])
    run_prefill(bm, a)  # 4 blocks, 3 full and cached
    bm.free(a)
    b = make_seq([9, 9])  # takes the uncached tail block first, then evicts the oldest freed: a's last full block
    run_prefill(bm, b)
    c = make_seq([8, 8, 8])
    run_prefill(bm, c)
    probe = make_seq([1, 2, 3, 4, 5, 6, 7])
    assert bm.allocate_cached_prefix(probe) == 2  # the first block survived; the tail went first


def test_block_key_covers_every_earlier_token():
    """The old key, Python's hash((parent, adapter, tokens)), let two different parents give one child key
    (in CPython hash(-1) == hash(-2)); the sha256 chain ties a block's key to its whole prefix."""
    block = [5, 6, 7, 8]
    assert hash((-1, 0, tuple(block))) == hash((-2, 0, tuple(block)))  # the old scheme's collision
    key = hash_block(ROOT_KEY, block)
    assert len(key) == 32 and key == hash_block(ROOT_KEY, list(block))
    parent_a, parent_b = hash_block(ROOT_KEY, [1, 2, 3, 4]), hash_block(ROOT_KEY, [1, 2, 3, 9])
    assert hash_block(parent_a, block) != hash_block(parent_b, block)
    assert hash_block(parent_a, block, (1, 1)) != hash_block(parent_a, block, (1, 2))


def test_prompts_differing_only_early_share_no_later_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    tail = list(range(40, 49))  # two full blocks and a token, equal in both prompts
    first = make_seq([1, 2, 3, 4] + tail)
    run_prefill(bm, first)
    second = make_seq([1, 2, 3, 9] + tail)
    assert bm.allocate_cached_prefix(second) == 0
    assert bm.allocate_slots(second, second.num_tokens)
    assert not set(first.block_table) & set(second.block_table)
    assert bm.allocate_cached_prefix(make_seq([1, 2, 3, 4] + tail)) == 12  # the same prompt still hits


def test_a_new_registration_of_a_lora_id_shares_no_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    run_prefill(bm, make_seq(list(range(10)), lora_id=1, lora_generation=1))
    assert bm.allocate_cached_prefix(make_seq(list(range(10)), lora_id=1, lora_generation=2)) == 0
    assert bm.allocate_cached_prefix(make_seq(list(range(10)), lora_id=1, lora_generation=1)) == 8


def test_a_growing_sequence_takes_the_block_after_its_last():
    """Blocks go back to the pool tail first, so a plain FIFO would hand a later request descending ids;
    the block after a sequence's last one is taken when it is free and uncached (its context is then one
    slice of the cache), and a cached block is never evicted for it."""
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=False)
    first = make_seq(list(range(36)))
    run_prefill(bm, first)  # blocks 0-8
    bm.free(first)  # back as 8, 7, ..., 0 after 9, 10, 11
    second = make_seq(list(range(100, 112)))
    run_prefill(bm, second)  # 9, 10, 11
    bm.free(second)
    third = make_seq([7])  # the pool offers 8 first (the last freed of `first`), then 7, 6, ... to a FIFO
    run_prefill(bm, third)
    for _ in range(12):  # decodes, a block every 4 tokens
        third.append_token(1)
        assert bm.allocate_slots(third, 1)
        third.num_computed_tokens += 1
    start = third.block_table[0]
    assert third.block_table == list(range(start, start + 4)), third.block_table

    cached = BlockManager(num_blocks=4, block_size=4)
    growing = make_seq([60])
    run_prefill(cached, growing)  # block 0
    full = make_seq(list(range(4)))
    run_prefill(cached, full)  # block 1, full and hashed
    cached.free(full)  # 1 is free but cached
    for _ in range(4):
        growing.append_token(1)
        assert cached.allocate_slots(growing, 1)
        growing.num_computed_tokens += 1
    assert growing.block_table == [0, 2] and 1 in cached.hash_to_block.values()
