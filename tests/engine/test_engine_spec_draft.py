"""Draft-model speculation: greedy outputs token-for-token equal to transformers' greedy generate for every
family with a smaller random draft of the same family (its guesses mostly wrong), and with the target as
its own draft, whose guesses are right whenever its paged KV cache is kept right: through chunked prefill,
preemption and the prefix cache, its acceptance stays near 100%. Config errors before any weight is read."""
from __future__ import annotations

import pytest
import torch
from test_engine_correctness import FAMILIES, MAX_TOKENS, PROMPTS
from test_engine_spec_decode import greedy, run_checked

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.lora.request import LoRARequest


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory) -> dict[str, str]:
    """A smaller model of each family (one layer, half the width), same tokenizer, other weights."""
    from kubeinfer.dev.testing.random_model import build_random_model

    root = tmp_path_factory.mktemp("drafts")
    return {family: str(build_random_model(root / family, family, hidden_size=32, num_layers=1, num_heads=2,
                                           num_kv_heads=1, intermediate_size=64, seed=100 + i))
            for i, family in enumerate(FAMILIES)}


def draft_config(model: str, k: int = 3) -> dict:
    return {"model": model, "num_speculative_tokens": k}


def check_draft_cache(engine) -> None:
    """With the target as its own draft, the draft cache holds the target's K/V wherever both say they
    computed a sequence's tokens (at the slots of its block table as it stands now)."""
    draft = engine.speculator.draft
    bs = engine.block_manager.block_size
    for seq in engine.scheduler.running:
        positions = range(min(draft.computed(seq), seq.num_computed_tokens))
        slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in positions], dtype=torch.long)
        for (k, v), (draft_k, draft_v) in zip(engine.runner.kv_caches, draft.runner.kv_caches):
            for target, ours in ((k, draft_k), (v, draft_v)):
                torch.testing.assert_close(ours.flatten(0, 1)[slots], target.flatten(0, 1)[slots], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_small_draft_keeps_greedy_exact(family, model_dirs, draft_dirs, references):
    llm = LLM(model_dirs[family], block_size=4, speculative_config=draft_config(draft_dirs[family]))
    outputs = run_checked(llm, PROMPTS, [greedy(n) for n in MAX_TOKENS])
    assert [o.token_ids for o in outputs] == references(family)
    speculator = llm.engine.speculator
    assert speculator.draft is not None and speculator.num_draft_tokens > 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_target_as_its_own_draft_is_right_through_preemption_and_the_prefix_cache(family, model_dirs, references):
    # 14 blocks of 4 tokens cannot hold the batch: sequences are preempted and recomputed, prompts are
    # prefilled in chunks of 16 tokens, and the second pass finds the first one's blocks in the prefix cache.
    llm = LLM(model_dirs[family], block_size=4, num_kv_blocks=14, max_num_batched_tokens=16,
              speculative_config=draft_config(model_dirs[family]))
    engine = llm.engine
    step = engine.step

    def checked_step():
        outputs = step()
        check_draft_cache(engine)
        return outputs
    engine.step = checked_step
    for _ in range(2):
        outputs = run_checked(llm, PROMPTS, [greedy(n) for n in MAX_TOKENS])
        assert [o.token_ids for o in outputs] == references(family)
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.prefix_hits > 0
    speculator = engine.speculator
    # A draft K/V written at a wrong slot, or kept after a preemption, makes its guesses near random.
    assert speculator.num_draft_tokens > 50 and speculator.acceptance_rate > 0.9


def test_sampled_drafts_from_the_target_itself_are_accepted(llama_dir):
    """For a sampled request the draft draws its drafts from its own distribution q under the request's
    rules and passes q on: with the target as its own draft q equals p, so min(1, p / q) accepts nearly
    every draft (greedy guesses would be accepted with probability p(guess) only: a few percent at
    temperature 1 over a random model's vocabulary), and a seed still gives the same tokens."""
    def run() -> tuple[list[list[int]], float]:
        llm = LLM(llama_dir, block_size=4, speculative_config=draft_config(llama_dir, k=4))
        params = [SamplingParams(temperature=1.0, top_k=50, seed=s, max_tokens=16, ignore_eos=True) for s in (1, 2)]
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params)
        speculator = llm.engine.speculator
        assert speculator.num_draft_tokens > 10
        return [o.outputs[0].token_ids for o in outputs], speculator.acceptance_rate

    (first, acceptance), (second, _) = run(), run()
    assert first == second and acceptance > 0.9, acceptance


def test_sampled_and_lora_requests_run_beside_greedy_ones(llama_dir, draft_dirs, tmp_path):
    """The draft has no adapter (its guesses for a LoRA request are worse, not wrong); sampled
    requests keep the target's distribution by rejection sampling and are reproducible by seed."""
    from kubeinfer.dev.testing.random_model import build_random_adapter

    adapter = build_random_adapter(tmp_path / "adapter", llama_dir, rank=4, scale=0.3, seed=3)

    def run() -> list[list[int]]:
        llm = LLM(llama_dir, block_size=4, enable_lora=True, max_lora_rank=8,
                  speculative_config=draft_config(llama_dir))
        params = [greedy(12), SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)]
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params)
        with_adapter = llm.generate([{"prompt_token_ids": PROMPTS[2]}], greedy(12),
                                    lora_request=LoRARequest("a", 1, str(adapter)))
        assert llm.engine.speculator.num_draft_tokens > 0
        return [o.outputs[0].token_ids for o in outputs + with_adapter]

    first, second = run(), run()
    assert first == second and all(len(t) == 12 for t in first)
    plain = LLM(llama_dir, block_size=4, enable_lora=True, max_lora_rank=8)
    reference = plain.generate([{"prompt_token_ids": PROMPTS[2]}], greedy(12),
                               lora_request=LoRARequest("a", 1, str(adapter)))
    assert first[2] == reference[0].outputs[0].token_ids


@pytest.mark.parametrize("make, message", [
    (lambda d: {"method": "draft_model", "num_speculative_tokens": 4}, 'needs "model"'),
    (lambda d: {"model": "/nonexistent/draft", "num_speculative_tokens": 4}, "speculative_config model:"),
    (lambda d: {"model": d["short"], "num_speculative_tokens": 4}, "max_position_embeddings (64) is below"),
    (lambda d: {"model": d["other_tokenizer"], "num_speculative_tokens": 4}, "another tokenizer"),
])
def test_bad_draft_models_are_refused_before_serving(llama_dir, tmp_path_factory, make, message):
    from kubeinfer.dev.testing.random_model import build_random_model

    root = tmp_path_factory.mktemp("bad-drafts")
    drafts = {"short": str(build_random_model(root / "short", "llama", max_position_embeddings=64)),
              "other_tokenizer": str(build_random_model(root / "other", "llama", vocab_size=300))}
    with pytest.raises(ValueError) as error:
        LLM(llama_dir, speculative_config=make(drafts))
    assert message in str(error.value)
