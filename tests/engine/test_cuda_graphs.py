"""Decode steps through captured graphs (kubeinfer/engine/platforms/cuda/cuda_graphs.py) give exactly the eager
engine's tokens.

On the CPU the graph path runs with `replay_eagerly` in place of the CUDA capture: static buffers,
padding to the next captured size, padding rows that must not touch the KV cache, and logits read
from the static output are all exercised; only the recording itself needs a GPU. With CUDA the same
engine test captures real graphs. References: transformers' greedy `generate` on the same weights.
"""
from __future__ import annotations

import pytest
import torch
from test_triton_kernels import DEVICES, MAX_TOKENS, PROMPTS, engine_greedy, hf_greedy


def test_capture_sizes_ladder_ends_at_max_num_seqs():
    from kubeinfer.engine.platforms.cuda.cuda_graphs import capture_sizes

    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(4096)[-1] == 512  # larger decode batches are compute-bound: they run eagerly


def _capture(llm, device):
    from kubeinfer.engine.platforms.cuda.cuda_graphs import capture_cuda_graph, replay_eagerly

    runner = llm.engine.runner
    runner.capture_decode_graphs(llm.engine.config.max_num_seqs,
                                 capture=capture_cuda_graph if device == "cuda" else replay_eagerly)
    return runner.graphs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["synchronous", "async-scheduling"])
@pytest.mark.parametrize("device", DEVICES)
def test_decode_graphs_match_transformers_with_padding_and_preemption(device, async_scheduling, model_dirs,
                                                                      hf_models):
    """With async scheduling each decode row's input id is written into the graph's static buffer on the
    device, from the previous step's sampled ids, after the host's copy."""
    from kubeinfer.engine import LLM

    want = [hf_greedy(hf_models("qwen3"), p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    # 5 sequences finish at different steps, so decode batches of 5, 4, 3 (padded to 4), 2 and 1 occur;
    # too few blocks force preemption, and 4-token blocks make tables of several columns.
    llm = LLM(model_dirs["qwen3"], device=device, dtype="float32", attention_backend="triton", block_size=4,
              num_kv_blocks=14, max_num_batched_tokens=16, max_num_seqs=5, enforce_eager=True,
              async_scheduling=async_scheduling)
    graphs = _capture(llm, device)
    assert graphs.sizes == [1, 2, 4, 5]
    padded, filled = [], []
    original_run = graphs.run

    def spy(input_ids, *args, **kwargs):
        padded.append((len(input_ids), graphs.padded_size(len(input_ids))))
        filled.append(any(a is not None for a in args[5:]) or kwargs.get("fill") is not None)
        return original_run(input_ids, *args, **kwargs)

    graphs.run = spy
    assert engine_greedy(llm) == want
    assert graphs.num_replays > 0 and (3, 4) in padded
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(filled) == async_scheduling


@pytest.mark.parametrize("device", DEVICES)
def test_decode_graphs_with_a_sliding_window(device, tmp_path):
    from kubeinfer.engine import LLM
    from kubeinfer.dev.testing.random_model import build_random_model
    from transformers import AutoModelForCausalLM

    model_dir = str(build_random_model(tmp_path / "mistral", "mistral", tokenizer=False, sliding_window=8, seed=11))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    llm = LLM(model_dir, device=device, dtype="float32", attention_backend="triton", block_size=8, max_num_seqs=8,
              enforce_eager=True, num_kv_blocks=64)  # a fixed cache, not 90% of the GPU: GPU tests share one
    graphs = _capture(llm, device)
    assert engine_greedy(llm) == want
    assert graphs.num_replays > 0


def test_which_steps_replay_a_graph(model_dirs):
    from kubeinfer.engine import LLM
    from kubeinfer.engine.platforms.cuda.cuda_graphs import DecodeGraphs, replay_eagerly
    from kubeinfer.engine.model_executor.model_runner import StepInputs

    llm = LLM(model_dirs["llama"], dtype="float32", attention_backend="torch", max_num_seqs=4)
    runner = llm.engine.runner
    with pytest.raises(ValueError, match="cannot run in CUDA graphs.*triton"):
        runner.capture_decode_graphs(4, capture=replay_eagerly)
    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, sizes=[1, 2, 4], max_blocks_per_seq=4,
                                 vocab_size=runner.spec.vocab_size, device=runner.device, sliding_window=None)
    decode = StepInputs(context_lens=[5, 6], num_decodes=2)
    assert runner._graph_can_run(decode, None)
    assert not runner._graph_can_run(StepInputs(context_lens=[5, 9], num_decodes=1), None)  # a prefill in the step
    assert not runner._graph_can_run(StepInputs(context_lens=[5] * 5, num_decodes=5), None)  # beyond the largest graph
    assert not runner._graph_can_run(decode, [1, 0])  # adapters, and no graphs were captured for them
    runner.graphs.lora_replays[2] = lambda: None
    assert runner._graph_can_run(decode, [1, 0])


@pytest.mark.parametrize("device", DEVICES)
def test_decode_graphs_with_adapters_match_peft(device, lora_base_dir, lora_adapters, lora_base_reference):
    """Mixed base/adapter decode batches replayed from the LoRA graphs (one kernel segment per token)."""
    from lora_helpers import MAX_TOKENS, mixed_batch

    from kubeinfer.engine import LLM, SamplingParams

    prompts, loras, want = mixed_batch(lora_adapters, lora_base_reference)
    # Two device slots for three adapters: slots are reassigned between steps, which graphs must follow.
    llm = LLM(str(lora_base_dir), device=device, dtype="float32", attention_backend="triton", enable_lora=True,
              max_loras=2, max_lora_rank=8, block_size=4, max_num_seqs=6, enforce_eager=True,
              num_kv_blocks=64)  # a fixed cache, not 90% of the GPU: GPU tests share one
    graphs = _capture(llm, device)
    assert sorted(graphs.lora_replays) == graphs.sizes
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * len(prompts), lora_request=loras)]
    assert got == want
    assert graphs.num_lora_replays > 0
    base_only = llm.generate(prompts[:1], params)[0].outputs[0].token_ids  # the plain graphs again
    assert base_only == want[0] and graphs.num_replays > graphs.num_lora_replays


def test_capture_needs_the_kv_cache(model_dirs):
    from kubeinfer.engine.platforms.cuda.cuda_graphs import replay_eagerly
    from kubeinfer.engine.model_executor.model_loader import inspect_model_dir
    from kubeinfer.engine.model_executor.model_runner import ModelRunner

    runner = ModelRunner(inspect_model_dir(model_dirs["llama"]), device=torch.device("cpu"), dtype=torch.float32,
                         max_model_len=64, block_size=16)
    with pytest.raises(RuntimeError, match="allocate the KV cache"):
        runner.capture_decode_graphs(4, capture=replay_eagerly)


def test_enforce_eager_flag_parses():
    import argparse

    from kubeinfer.engine.entrypoints.serve import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["/models/x", "--enforce-eager", "--gpu-memory-utilization", "0.5"])
    assert args.enforce_eager is True and args.gpu_memory_utilization == 0.5
    assert parser.parse_args(["/models/x"]).enforce_eager is False
