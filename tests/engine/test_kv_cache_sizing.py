"""KV-cache sizing from GPU memory (`--gpu-memory-utilization`) and the profiling step it relies on."""
from __future__ import annotations

import pytest
import torch

from test_triton_kernels import DEVICES  # also sets TRITON_INTERPRET=1 without CUDA, before triton loads

from kubeinfer.engine.core.kv_cache_sizing import GiB, GpuMemoryProfile, kv_cache_bytes, num_kv_blocks

H100 = 80 * GiB


def test_the_share_minus_weights_activations_and_other_memory_goes_to_the_cache():
    profile = GpuMemoryProfile(total=H100, free_at_start=79 * GiB, torch_peak=3 * GiB, non_torch_growth=GiB // 2)
    assert kv_cache_bytes(profile, 0.9) == int(H100 * 0.9) - 3 * GiB - GiB // 2
    assert kv_cache_bytes(profile, 0.5) == int(H100 * 0.5) - 3 * GiB - GiB // 2


def test_a_share_larger_than_what_is_free_is_refused_with_the_flag_to_change():
    busy = GpuMemoryProfile(total=H100, free_at_start=40 * GiB, torch_peak=3 * GiB, non_torch_growth=0)
    with pytest.raises(ValueError, match=r"only 40.00 of 80.00 GiB were free.*--gpu-memory-utilization"):
        kv_cache_bytes(busy, 0.9)
    assert kv_cache_bytes(busy, 0.45) == int(H100 * 0.45) - 3 * GiB  # two engines at 0.45 share one GPU


def test_weights_larger_than_the_share_leave_nothing_for_the_cache():
    big = GpuMemoryProfile(total=H100, free_at_start=H100, torch_peak=70 * GiB, non_torch_growth=GiB)
    with pytest.raises(ValueError, match="no memory is left for the KV cache"):
        kv_cache_bytes(big, 0.8)


@pytest.mark.parametrize("utilization", [0, -0.1, 1.5])
def test_utilization_outside_zero_one_is_refused(utilization):
    from kubeinfer.engine.config import EngineConfig

    profile = GpuMemoryProfile(total=H100, free_at_start=H100, torch_peak=0, non_torch_growth=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_bytes(profile, utilization)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model="m", gpu_memory_utilization=utilization)


def test_blocks_must_hold_one_sequence_of_max_model_len():
    per_block = 2 * 16 * 16 * 8 * 64 * 2  # Llama-3.2-1B shape, bf16, 16-token blocks: 512 KiB
    assert num_kv_blocks(10 * GiB, per_block, block_size=16, max_model_len=8192) == 10 * GiB // per_block
    with pytest.raises(ValueError, match="fewer than one sequence of max_model_len 131072.*--max-model-len"):
        num_kv_blocks(1 * GiB, per_block, block_size=16, max_model_len=131072)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=DEVICES[0].marks)])
def test_profile_run_leaves_the_served_cache_untouched(model_dirs, backend):
    """The profiling step uses a scratch cache: the served cache and what later steps compute are unchanged."""
    from kubeinfer.engine import LLM, SamplingParams

    llm = LLM(model_dirs["qwen2"], dtype="float32", max_num_seqs=4, num_kv_blocks=64, attention_backend=backend)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    before = llm.generate([{"prompt_token_ids": [3, 4, 5, 6]}], params)[0].outputs[0].token_ids
    runner = llm.engine.runner
    cache_before = [k.clone() for k, _ in runner.kv_caches]
    runner.profile_run(num_tokens=150, max_num_seqs=4)  # 4 prompts of 37-38 tokens
    runner.profile_run(num_tokens=3, max_num_seqs=8)  # fewer tokens than sequences
    assert all(torch.equal(k, want) for (k, _), want in zip(runner.kv_caches, cache_before))
    assert llm.generate([{"prompt_token_ids": [3, 4, 5, 6]}], params)[0].outputs[0].token_ids == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_engine_sizes_its_cache_from_gpu_memory(llama_dir):
    from kubeinfer.engine import LLM

    small = LLM(llama_dir, device="cuda", gpu_memory_utilization=0.2, enforce_eager=True)
    per_block = small.engine.runner.kv_bytes_per_block(small.engine.spec, 16, small.engine.dtype)
    total = torch.cuda.mem_get_info()[1]
    assert small.engine.num_kv_blocks * per_block <= 0.2 * total
    assert small.engine.num_kv_blocks * per_block > 0.1 * total  # a tiny model: most of the share is cache


def test_serve_refuses_a_bad_share_in_one_line(llama_dir):
    import argparse

    from kubeinfer.engine.entrypoints.serve import add_serve_arguments, build_state

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    with pytest.raises(SystemExit, match=r"^kubeinfer serve: gpu_memory_utilization must be a fraction in \(0, 1\]"):
        build_state(parser.parse_args([llama_dir, "--gpu-memory-utilization", "1.5"]))


def test_running_out_of_gpu_memory_at_start_up_says_what_to_change():
    from kubeinfer.engine.core.kv_cache_sizing import out_of_memory_says

    with pytest.raises(ValueError, match=r"^the profiling step ran out of GPU memory \(CUDA out of memory\. Tried to "
                                         r"allocate 2\.00 GiB\); lower --max-num-batched-tokens$"):
        with out_of_memory_says("the profiling step", "lower --max-num-batched-tokens"):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore details")
