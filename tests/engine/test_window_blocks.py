"""Sliding-window layers' KV blocks freed once out of every window (core/window_blocks.py), on a Gemma 3
model with 8-token windows and 4-token blocks: outputs stay equal to transformers' while the windowed
layers hold a few blocks per sequence; a cached prefix is reused only where its window blocks are held."""
import pytest
import torch
from test_model_families import MAX_TOKENS, PROMPTS, hf_greedy, hf_references, run

from kubeinfer.engine import LLM, SamplingParams

S, F = "sliding_attention", "full_attention"
WINDOW, BLOCK = 8, 4
LONG = list(range(20, 80))


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    return str(build_random_model(tmp_path_factory.mktemp("gemma3_window"), "gemma3", tokenizer=False, seed=12,
                                  num_layers=3, sliding_window=WINDOW, layer_types=[S, F, S]))


@pytest.fixture(scope="module")
def long_reference(gemma_dir):
    from transformers import AutoModelForCausalLM

    return hf_greedy(AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval(), LONG, 20)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_a_long_request_holds_only_its_window_in_the_window_pool(gemma_dir, long_reference):
    llm = LLM(gemma_dir, block_size=BLOCK, max_num_batched_tokens=16)
    engine, bm = llm.engine, llm.engine.block_manager
    assert type(bm).__name__ == "HybridBlockManager"
    engine.add_request("long", {"prompt_token_ids": LONG}, greedy(20))
    held, out = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            out = output.outputs[0].token_ids if output.finished else out
        if engine.scheduler.running:
            seq = engine.scheduler.running[0]
            in_use = bm.windowed.num_blocks - 1 - bm.windowed.num_free_blocks
            held.append((len(seq.block_table), in_use))
    assert out == long_reference
    # The full layers hold a block per 4 tokens (up to 20 for 79 tokens); the windowed ones at most the blocks
    # of the last 7 tokens and the step's new ones: 3 (16-token chunks while prefilling: 2 after each).
    assert max(full for full, _ in held) == 20
    assert max(window for _, window in held) <= 3
    assert bm.num_free_blocks == bm.num_blocks and bm.windowed.num_free_blocks == bm.windowed.num_blocks - 1


def test_a_cached_prefix_is_reused_only_with_its_window_blocks(gemma_dir, long_reference):
    llm = LLM(gemma_dir, block_size=BLOCK)
    bm = llm.engine.block_manager

    def once() -> int:
        hits = bm.prefix_hits
        assert llm.generate([{"prompt_token_ids": LONG}], greedy(20))[0].outputs[0].token_ids == long_reference
        return bm.prefix_hits - hits

    assert once() == 0
    assert once() == 56  # 14 full blocks of the 60-token prompt (the last token is always computed)
    bm.windowed.reset_prefix_cache()  # the window pool forgets its blocks; the full pool still has the prefix
    assert once() == 0  # useless without the window's K/V: computed again
    assert once() == 56


def test_a_tight_window_pool_preempts_and_stays_exact(gemma_dir):
    """A small KV budget leaves the window pool 10 blocks for six sequences: it runs out first."""
    llm = LLM(gemma_dir, block_size=BLOCK, max_num_batched_tokens=16, kv_cache_memory_bytes=40 << 10)
    bm = llm.engine.block_manager
    assert bm.windowed.num_blocks - 1 == 10 and bm.num_blocks == 20
    assert run(llm) == hf_references(gemma_dir)
    assert llm.engine.scheduler.num_preemptions > 0
    assert bm.num_free_blocks == bm.num_blocks and bm.windowed.num_free_blocks == bm.windowed.num_blocks - 1


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_speculative_decoding_gives_back_rejected_window_blocks(gemma_dir, prefix_caching):
    llm = LLM(gemma_dir, block_size=BLOCK, num_kv_blocks=24, max_num_batched_tokens=16,
              enable_prefix_caching=prefix_caching,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert run(llm) == hf_references(gemma_dir)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == 24 and bm.windowed.num_free_blocks == 24
