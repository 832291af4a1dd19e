"""The native CPU tier (OffloadingConnector): prefixes evicted from a deliberately tiny device cache are saved to
host memory and loaded back, and greedy outputs stay those of the tier-off run and of transformers; failed loads
follow kv_load_failure_policy; block keys are the same in every process."""
import os
import subprocess
import sys
import types

import pytest
import torch

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.core.block_manager import ROOT_KEY, hash_block
from kubeinfer.engine.kv_transfer.cpu_tier import CPUBlockPool

# Six 40-token prompts (10 blocks of 4) over 24 device blocks: by the second round every prefix was evicted.
PROMPTS = [list(range(10 + 7 * i, 50 + 7 * i)) for i in range(6)]
MAX_TOKENS = 6
TINY_CACHE = dict(block_size=4, num_kv_blocks=24, max_num_seqs=2)
TIER = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": 256}}


def two_rounds(llm: LLM) -> list[list[int]]:
    """Each prompt alone, twice over: the second round's prefixes are long gone from the device cache."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for _ in range(2) for p in PROMPTS]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=MAX_TOKENS, min_new_tokens=0, do_sample=False, eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_reloaded_prefixes_keep_greedy_outputs(family, model_dirs, hf_models):
    tier_off = LLM(model_dirs[family], **TINY_CACHE)
    expected = two_rounds(tier_off)
    assert tier_off.engine.block_manager.prefix_hits == 0  # the device cache alone kept nothing for round two
    tier_on = LLM(model_dirs[family], **TINY_CACHE, kv_transfer_config=TIER)
    assert two_rounds(tier_on) == expected
    stats = tier_on.engine.kv_transfer.connector.stats
    assert stats.hits == len(PROMPTS) * 9 * 4  # round two: every full block but the one holding the last token
    assert stats.bytes_loaded > 0 and stats.bytes_saved > 0 and stats.load_failures == 0
    hf = hf_models(family)
    assert expected[len(PROMPTS):] == [hf_greedy(hf, p) for p in PROMPTS]


def test_reloaded_prefixes_keep_greedy_outputs_moe(tmp_path):
    from kubeinfer.dev.testing.random_model import build_random_model

    model = str(build_random_model(tmp_path / "moe", "qwen3_moe", seed=3))
    expected = two_rounds(LLM(model, **TINY_CACHE))
    tier_on = LLM(model, **TINY_CACHE, kv_offloading_size=0.01)
    assert two_rounds(tier_on) == expected and tier_on.engine.kv_transfer.connector.stats.hits > 0


def failing_loads(llm: LLM) -> None:
    def fail(block_ids, slots):
        raise OSError("injected: the tier's memory went away")
    llm.engine.kv_transfer.connector._read_blocks = fail


def test_failed_loads_recompute_and_are_counted(llama_dir):
    expected = two_rounds(LLM(llama_dir, **TINY_CACHE))
    llm = LLM(llama_dir, **TINY_CACHE, kv_transfer_config={**TIER, "kv_load_failure_policy": "recompute"})
    failing_loads(llm)
    assert two_rounds(llm) == expected
    stats = llm.engine.kv_transfer.connector.stats
    assert stats.load_failures == stats.recomputed == len(PROMPTS) and stats.bytes_loaded == 0


def test_failed_loads_fail_the_request_under_policy_fail(llama_dir):
    llm = LLM(llama_dir, **TINY_CACHE, kv_transfer_config={**TIER, "kv_load_failure_policy": "fail"})
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt in PROMPTS:
        llm.generate([{"prompt_token_ids": prompt}], params)
    failing_loads(llm)
    output = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)[0]
    assert output.outputs[0].finish_reason == "abort" and output.outputs[0].token_ids == []
    assert "OffloadingConnector tier failed (kv_load_failure_policy=fail)" in output.error
    assert llm.engine.kv_transfer.connector.stats.load_failures == 1
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks  # nothing leaked
    fresh = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0]  # the engine goes on
    assert len(fresh.outputs[0].token_ids) == MAX_TOKENS


def test_block_keys_are_equal_across_processes():
    """The tier (and KV events) key blocks by sha256 of fixed-width ints: no PYTHONHASHSEED in it."""
    code = ("from kubeinfer.engine.core.block_manager import ROOT_KEY, hash_block; "
            "print(hash_block(hash_block(ROOT_KEY, [1, 2, 3, 4]), [5, 6, 7, 8], (3, 1)).hex())")
    here = hash_block(hash_block(ROOT_KEY, [1, 2, 3, 4]), [5, 6, 7, 8], (3, 1)).hex()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == here
    assert hash_block(ROOT_KEY, [1, 2, 3, 4], (3, 1)) != hash_block(ROOT_KEY, [1, 2, 3, 4], (3, 2))  # adapter-aware


def test_pool_lru_passes_over_slots_with_pending_transfers():
    pool = CPUBlockPool(2, (1,), torch.uint8, pin_memory=False)
    a, b, c = pool.allocate(b"a"), pool.allocate(b"b"), pool.allocate(b"c")
    assert (a, b, c) == (0, 1, None)  # both slots pinned by this step's saves
    assert pool.allocate(b"a") is None  # already stored
    pool.unpin_all()
    pool.touch(b"a")
    assert pool.allocate(b"c") == 1 and pool.lookup(b"b") is None  # b was least recently used
    pool.unpin_all()
    pool.pin(0)  # a load of "a" pending: "a" stays although it is now the oldest
    assert pool.allocate(b"d") == 1 and pool.lookup(b"a") == 0


def test_metrics_use_vllm_names(llama_dir):
    from prometheus_client import generate_latest

    from kubeinfer.engine.entrypoints.metrics import EngineMetrics

    llm = LLM(llama_dir, **TINY_CACHE, kv_transfer_config=TIER)
    two_rounds(llm)
    fake = types.SimpleNamespace(engine=llm.engine, output_observers=[], abort_observers=[], num_running=0,
                                 num_waiting=0)
    text = generate_latest(EngineMetrics(fake, "tiny").registry).decode()
    stats = llm.engine.kv_transfer.connector.stats
    assert f'vllm:external_prefix_cache_hits_total{{model_name="tiny"}} {float(stats.hits)}' in text
    assert f'vllm:external_prefix_cache_queries_total{{model_name="tiny"}} {float(stats.queries)}' in text
    assert (f'vllm:kv_offload_total_bytes_total{{model_name="tiny",transfer_type="CPU_to_GPU"}} '
            f'{float(stats.bytes_loaded)}') in text
    assert 'vllm:kv_offload_total_time_total{model_name="tiny",transfer_type="GPU_to_CPU"}' in text
    stored, _ = llm.engine.kv_transfer.connector.occupancy()
    assert f'kubeinfer:kv_offload_cpu_blocks{{model_name="tiny"}} {float(stored)}' in text and stored > 0
    assert 'kubeinfer:kv_load_recomputed_total{model_name="tiny"} 0.0' in text


def test_models_with_a_window_pool_are_refused_clearly(tmp_path):
    """Gemma 2 mixes windowed and full layers: offloading the full pool alone would reload prefixes without their
    windowed layers' K/V, so the engine refuses the tier rather than serve wrong tokens (later: offload both)."""
    from kubeinfer.dev.testing.random_model import build_random_model

    model = str(build_random_model(tmp_path / "gemma2", "gemma2", seed=5))
    LLM(model, block_size=4, num_kv_blocks=32)  # the model itself runs
    with pytest.raises(ValueError, match="mixing windowed and full-attention layers"):
        LLM(model, block_size=4, num_kv_blocks=32, kv_offloading_size=0.01)


@pytest.mark.parametrize("extra", [{}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                               "prompt_lookup_max": 3, "prompt_lookup_min": 1}},
                                   {"async_scheduling": True}], ids=["batched", "spec-decode", "async-scheduling"])
def test_tier_under_preemption_spec_decode_and_async_scheduling(llama_dir, extra):
    """All prompts at once in the tiny cache: sequences are preempted, their blocks evicted and saved, and
    reloaded on readmission; with speculative decoding (rejected drafts' blocks freed) and async scheduling
    the outputs stay the tier-off ones."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)  # two sequences outgrow the cache
    batch = [{"prompt_token_ids": p} for p in PROMPTS + [PROMPTS[0][:20] * 2]]  # the last repeats: drafts
    cache = {**TINY_CACHE, "max_num_seqs": 4}

    def run(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for _ in range(2) for o in llm.generate(batch, params)]
    expected = run(LLM(llama_dir, **cache))
    llm = LLM(llama_dir, **cache, kv_transfer_config=TIER, **extra)
    assert run(llm) == expected
    assert llm.engine.kv_transfer.connector.stats.hits > 0 and llm.engine.scheduler.num_preemptions > 0
    if extra.get("speculative_config"):
        assert llm.engine.speculator.num_draft_tokens > 0


def test_8_bit_kv_cache_blocks_move_bit_exact(llama_dir):
    """The tier copies bytes, whatever the cache dtype: with an fp8 cache the outputs stay the tier-off ones."""
    expected = two_rounds(LLM(llama_dir, **TINY_CACHE, kv_cache_dtype="fp8"))
    llm = LLM(llama_dir, **TINY_CACHE, kv_cache_dtype="fp8", kv_transfer_config=TIER)
    assert two_rounds(llm) == expected and llm.engine.kv_transfer.connector.stats.hits > 0


def test_lora_blocks_come_back_to_their_own_adapter(lora_base_dir, lora_adapters, lora_base_reference):
    """Every prompt under the base model and each adapter, one request at a time, twice, in a cache of 12 blocks:
    the second pass reloads each (prompt, adapter)'s blocks from the tier, and the outputs stay PEFT's (a block
    served to another adapter would change them)."""
    from lora_helpers import mixed_batch

    prompts, loras, expected = mixed_batch(lora_adapters, lora_base_reference)
    llm = LLM(str(lora_base_dir), enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4, num_kv_blocks=12,
              max_num_seqs=1, kv_transfer_config=TIER)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for _ in range(2):
        outputs = [llm.generate([prompt], params, lora_request=lora)[0].outputs[0].token_ids
                   for prompt, lora in zip(prompts, loras)]
        assert outputs == expected
    assert llm.engine.kv_transfer.connector.stats.hits > 0


def test_an_eviction_during_admission_never_takes_a_matched_slot():
    """A full tier whose oldest block is the one a request just matched: the device blocks its allocation evicts
    are saved elsewhere (or dropped), never over the slot its load reads."""
    from kubeinfer.engine.core.block_manager import BlockManager
    from kubeinfer.engine.kv_transfer.config import KVTransferConfig
    from kubeinfer.engine.kv_transfer.offloading import OffloadingConnector

    bs = 2
    config = KVTransferConfig("OffloadingConnector", kv_connector_extra_config={"num_cpu_blocks": 2})
    connector = OffloadingConnector(config, bs, num_layers=1, num_kv_heads=1, head_dim=2, cache_dtype=torch.float32,
                                    device=torch.device("cpu"), block_key=BlockManager.block_key)
    keys, values = torch.arange(16.0).view(4, bs, 1, 2), -torch.arange(16.0).view(4, bs, 1, 2)
    connector.register_kv_caches([(keys, values)])
    original = keys[0].clone()
    tokens = [5, 6, 7]
    key_a = BlockManager.block_key(None, tokens[:bs], (0, 0))
    connector.on_block_evicted(key_a, 0)
    connector.on_block_evicted(b"b" * 32, 1)
    connector.start_load_kv(connector.build_connector_meta())  # the tier is full, key_a its oldest block
    seq = types.SimpleNamespace(token_ids=tokens, num_tokens=3, num_prompt_tokens=3, block_hashes=[], lora_id=0,
                                lora_generation=0, num_preemptions=0, request_id="r")
    assert connector.get_num_new_matched_tokens(seq, 0) == (bs, False)
    connector.on_block_evicted(b"c" * 32, 2)  # the admission's allocation evicts a device block
    connector.update_state_after_alloc(seq, [3], bs)
    connector.start_load_kv(connector.build_connector_meta())
    assert torch.equal(keys[3], original) and connector.pool.lookup(key_a) is not None


def test_the_connector_hears_of_finished_requests(llama_dir):
    llm = LLM(llama_dir, **TINY_CACHE, kv_transfer_config=TIER)
    finished = []
    llm.engine.kv_transfer.connector.request_finished = lambda seq, block_ids: finished.append(
        (seq.request_id, len(block_ids))) or False
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert finished == [("0", 11)]  # 40 prompt + 2 generated tokens (the last not yet in the cache): 11 blocks
