"""Greedy outputs token-for-token equal to transformers' generate, for every supported family,
with mixed prompt lengths in one batch, prefix caching on and off, chunked prefill and preemption."""
import pytest
import torch

from kubeinfer.engine import LLM, SamplingParams

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Prompt lengths vary several-fold; two prompts share a 12-token prefix so the prefix cache is exercised.
PROMPTS = [
    [11, 12, 13, 14, 15, 16, 17],
    [40, 41, 42],
    list(range(60, 100)),
    list(range(100, 112)) + [5, 6, 7, 8, 9],
    list(range(100, 112)) + [200, 201],
    [7],
]
MAX_TOKENS = [12, 20, 9, 16, 5, 24]


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False,
                            eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def references(hf_models):
    cache = {}

    def get(family: str):
        if family not in cache:
            model = hf_models(family)
            cache[family] = [hf_greedy(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
        return cache[family]
    return get


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [greedy(n) for n in MAX_TOKENS])
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_batch_matches_transformers(family, prefix_caching, model_dirs, references):
    llm = LLM(model_dirs[family], block_size=4, enable_prefix_caching=prefix_caching)
    assert run(llm) == references(family)
    # A second pass: with prefix caching on, the prompts now hit cached blocks.
    assert run(llm) == references(family)
    if prefix_caching:
        assert llm.engine.block_manager.prefix_hits > 0
    else:
        assert llm.engine.block_manager.prefix_hits == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_preemption_keep_outputs_exact(family, model_dirs, references):
    # 12 blocks of 4 tokens cannot hold the batch at once: sequences are preempted and recomputed.
    # A 16-token budget splits the long prompts into chunks mixed with decodes.
    llm = LLM(model_dirs[family], block_size=4, num_kv_blocks=14, max_num_batched_tokens=16)
    assert run(llm) == references(family)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 14  # everything returned


def test_lone_prompts_match_their_batched_selves(llama_dir):
    llm = LLM(llama_dir, block_size=8)
    batched = run(llm)
    alone = [llm.generate([{"prompt_token_ids": p}], greedy(n))[0].outputs[0].token_ids
             for p, n in zip(PROMPTS, MAX_TOKENS)]
    assert alone == batched
