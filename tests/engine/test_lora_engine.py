"""Batched multi-LoRA in the engine: greedy outputs token-for-token equal to transformers + PEFT for
batches mixing the base model and several adapters, with more adapters in use than device slots."""
from __future__ import annotations

import shutil

import pytest
from lora_helpers import ADAPTERS, MAX_TOKENS, PROMPTS, mixed_batch

from kubeinfer.engine import LLM, LoRARequest, SamplingParams
from kubeinfer.engine.lora.adapter import LoRALoadError


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _run(llm, prompts, loras):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, [_params()] * len(prompts), lora_request=loras)]


@pytest.mark.parametrize("max_loras", [3, 1], ids=["all-adapters-on-device", "pool-swaps"])
def test_mixed_batch_matches_peft(max_loras, lora_base_dir, lora_adapters, lora_base_reference):
    prompts, loras, expected = mixed_batch(lora_adapters, lora_base_reference)
    # The adapters change the outputs, so equality below is about the adapters, not the base model.
    assert all(lora_adapters[n][1] != lora_base_reference for n in ADAPTERS)
    llm = LLM(str(lora_base_dir), enable_lora=True, max_loras=max_loras, max_lora_rank=8, block_size=4)
    assert _run(llm, prompts, loras) == expected
    assert _run(llm, prompts, loras) == expected  # again, now with cached prefixes of every adapter
    assert llm.engine.block_manager.prefix_hits > 0
    pool = llm.engine.lora.pool
    assert len(pool.active_names()) <= max_loras and not pool.pinned_names()


def test_host_cache_rereads_evicted_adapters(lora_base_dir, lora_adapters, lora_base_reference):
    prompts, loras, expected = mixed_batch(lora_adapters, lora_base_reference)
    llm = LLM(str(lora_base_dir), enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8, block_size=4)
    assert _run(llm, prompts, loras) == expected
    assert len(llm.engine.lora.pool.cached_names()) == 1


def test_adapters_never_share_kv_blocks(lora_base_dir, lora_adapters, lora_base_reference):
    llm = LLM(str(lora_base_dir), enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4)
    prompt = [{"prompt_token_ids": PROMPTS[2]}]
    bm = llm.engine.block_manager
    assert _run(llm, prompt, None) == [lora_base_reference[2]]
    for name in ("attn", "mlp"):
        request, reference = lora_adapters[name]
        hits = bm.prefix_hits
        assert _run(llm, prompt, request) == [reference[2]]
        assert bm.prefix_hits == hits  # the base model's (and the other adapter's) blocks are not reused
    hits = bm.prefix_hits
    assert _run(llm, prompt, lora_adapters["mlp"][0]) == [lora_adapters["mlp"][1][2]]
    assert bm.prefix_hits > hits  # the same adapter does reuse its own blocks


def test_reused_lora_id_never_gets_the_unloaded_adapters_blocks(lora_base_dir, lora_adapters):
    """Adapter A runs under id 1 (its blocks are cached), is unloaded, and B is loaded under id 1: B's
    request must find none of A's blocks, and give what transformers + PEFT give for B."""
    llm = LLM(str(lora_base_dir), enable_lora=True, max_loras=1, max_lora_rank=8, block_size=4)
    bm = llm.engine.block_manager
    prompt = [{"prompt_token_ids": PROMPTS[2]}]  # 21 tokens: 5 full blocks to cache
    (path_a, reference_a), (path_b, reference_b) = [(lora_adapters[n][0].lora_path, lora_adapters[n][1][2])
                                                    for n in ("attn", "mlp")]
    assert _run(llm, prompt, LoRARequest("a", 1, path_a)) == [reference_a]
    llm.engine.remove_lora("a")
    hits = bm.prefix_hits
    out = llm.generate(prompt, _params(), lora_request=LoRARequest("b", 1, path_b))[0]
    assert out.num_cached_tokens == 0 and bm.prefix_hits == hits
    assert out.outputs[0].token_ids == reference_b
    assert _run(llm, prompt, LoRARequest("b", 1, path_b)) == [reference_b]
    assert bm.prefix_hits > hits  # B does reuse its own blocks


def test_waiting_adapter_runs_when_a_slot_frees(lora_base_dir, lora_adapters):
    """One slot, two adapters: the second adapter's request waits (reported as waiting) instead of failing."""
    from kubeinfer.engine import LLMEngine
    from kubeinfer.engine.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=str(lora_base_dir), enable_lora=True, max_loras=1, max_lora_rank=8))
    for name in ("attn", "mlp"):
        engine.add_lora(lora_adapters[name][0])
    engine.add_request("a", PROMPTS[0], _params(), lora_id=lora_adapters["attn"][0].lora_int_id)
    engine.add_request("b", PROMPTS[1], _params(), lora_id=lora_adapters["mlp"][0].lora_int_id)
    engine.step()
    assert engine.lora_adapter_names() == (["attn"], ["mlp"])
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["a"].outputs[0].token_ids == lora_adapters["attn"][1][0]
    assert finished["b"].outputs[0].token_ids == lora_adapters["mlp"][1][1]
    assert engine.lora_adapter_names() == ([], [])


def test_unload_waits_for_requests_in_flight(lora_base_dir, lora_adapters):
    from kubeinfer.engine import LLMEngine
    from kubeinfer.engine.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=str(lora_base_dir), enable_lora=True, max_loras=1, max_lora_rank=8))
    request, reference = lora_adapters["all"]
    engine.add_lora(request)
    engine.add_request("a", PROMPTS[0], _params(), lora_id=request.lora_int_id)
    engine.step()
    engine.remove_lora("all")
    with pytest.raises(ValueError, match="not loaded"):  # new requests can no longer name it
        engine.add_request("b", PROMPTS[0], _params(), lora_id=request.lora_int_id)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert outputs[0].outputs[0].token_ids == reference[0]  # finished with its adapter intact
    assert not engine.lora.pool.has(request.lora_int_id) and not engine.lora.retiring
    with pytest.raises(KeyError):
        engine.remove_lora("all")


def test_lora_errors(lora_base_dir, lora_adapters, tmp_path):
    request = lora_adapters["attn"][0]
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        LLM(str(lora_base_dir)).generate([PROMPTS[0]], _params(), lora_request=request)
    llm = LLM(str(lora_base_dir), enable_lora=True, max_loras=1, max_lora_rank=4)
    with pytest.raises(LoRALoadError, match="max_lora_rank=4"):
        llm.generate([PROMPTS[0]], _params(), lora_request=lora_adapters["mlp"][0])
    with pytest.raises(LoRALoadError, match="does not exist"):
        llm.generate([PROMPTS[0]], _params(), lora_request=LoRARequest("gone", 9, str(tmp_path / "gone")))
    llm.generate([PROMPTS[0]], _params(), lora_request=request)
    with pytest.raises(ValueError, match="already names adapter"):
        llm.generate([PROMPTS[0]], _params(), lora_request=LoRARequest("other", request.lora_int_id, request.lora_path))
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("x", 0, "/tmp")
    assert not llm.engine.has_unfinished_requests()


def test_adapter_removed_from_disk_fails_only_its_request(lora_base_dir, lora_adapters, tmp_path):
    """The pool dropped the adapter from host memory and its files are gone when it is needed again:
    that request ends with finish_reason 'abort'; the rest of the batch is served."""
    from kubeinfer.engine import LLMEngine
    from kubeinfer.engine.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=str(lora_base_dir), enable_lora=True, max_loras=1, max_cpu_loras=1,
                                    max_lora_rank=8))
    copied = shutil.copytree(lora_adapters["attn"][0].lora_path, tmp_path / "attn")
    engine.add_lora(LoRARequest("attn", 1, str(copied)))
    engine.add_lora(lora_adapters["mlp"][0])  # host cache of one: "attn" is dropped from memory
    shutil.rmtree(copied)
    engine.add_request("a", PROMPTS[0], _params(), lora_id=1)
    engine.add_request("b", PROMPTS[1], _params())
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["a"].outputs[0].finish_reason == "abort"
    assert len(finished["b"].outputs[0].token_ids) == MAX_TOKENS
    assert engine.block_manager.usage == 0


def test_random_adapter_builder_writes_peft_format(lora_base_dir, lora_base_reference, tmp_path):
    """build_random_adapter (benchmarks, demos) writes what PEFT itself loads, and we agree with PEFT on it."""
    from lora_helpers import hf_greedy, load_hf
    from peft import PeftModel

    from kubeinfer.dev.testing.random_model import build_random_adapter

    path = build_random_adapter(tmp_path / "random", lora_base_dir, rank=4, scale=0.3, seed=5)
    reference = hf_greedy(PeftModel.from_pretrained(load_hf(lora_base_dir), path).eval(), PROMPTS[0])
    assert reference != lora_base_reference[0]
    llm = LLM(str(lora_base_dir), enable_lora=True, max_lora_rank=4)
    assert _run(llm, [{"prompt_token_ids": PROMPTS[0]}], LoRARequest("random", 1, str(path))) == [reference]
