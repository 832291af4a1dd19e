"""Tensor parallelism on the CPU (gloo, 2 ranks): greedy outputs of LLM(tensor_parallel_size=2) equal to
transformers' for the supported families (mixed batch, prefix cache on, chunked prefill and forced
preemption in one engine), LoRA equal to PEFT, the KV budget per rank, a model whose heads do not divide
refused by name, and two "nodes" on loopback (`--headless`) giving the same tokens.
The served path (openai client, a killed rank) is in test_tensor_parallel_serve.py."""
import subprocess
import sys

import pytest
from lora_helpers import MAX_TOKENS as LORA_MAX_TOKENS
from lora_helpers import mixed_batch
from server_harness import free_port
from test_model_families import VARIANTS, hf_references, run

from kubeinfer.engine import LLM, SamplingParams

# family -> (random_model family, its switches): KV heads 2 (split) or 1 (replicated on both ranks)
MODELS = {
    "llama-kv-replicated": ("llama", dict(num_kv_heads=1)),
    "qwen2": ("qwen2", {}),
    "gemma3": ("gemma3", VARIANTS["gemma3"]),
    "llama": ("llama", {}),
    "mistral": ("mistral", dict(sliding_window=8)),
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", VARIANTS["gemma2"]),
    "phi3": ("phi3", VARIANTS["phi3"]),
    "granite": ("granite", VARIANTS["granite"]),
    "olmo2": ("olmo2", VARIANTS["olmo2"]),
    "olmo2-kv-replicated": ("olmo2", dict(num_kv_heads=1)),  # its k norm spans a head held by both ranks
}
# Replicated KV heads; Gemma 3's windows, q/k norms and tied embeddings. Split KV heads and Qwen2's biases run in
# the LoRA, KV-budget and failure tests below (and in test_tensor_parallel_serve.py).
DEFAULT_SUITE = ("llama-kv-replicated", "gemma3")


@pytest.fixture(scope="module")
def tp_dirs(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    root = tmp_path_factory.mktemp("tp_models")
    cache = {}

    def get(name: str) -> str:
        if name not in cache:
            family, switches = MODELS[name]
            cache[name] = str(build_random_model(root / name, family, tokenizer=False, seed=40, **switches))
        return cache[name]
    return get


@pytest.mark.parametrize("name", [n if n in DEFAULT_SUITE else pytest.param(n, marks=pytest.mark.slow)
                                  for n in MODELS])
def test_greedy_outputs_equal_transformers(name, tp_dirs):
    assert_two_ranks_equal_transformers(tp_dirs(name), run, hf_references)


def assert_two_ranks_equal_transformers(model_dir: str, run, hf_references, inspect=None) -> None:
    """`run(llm)` on 2 ranks gives `hf_references(model_dir)` through chunked prefill and preemption, then
    again with the prompts' blocks cached; `inspect(llm)` checks the split model first (the MoE tests)."""
    llm = LLM(model_dir, block_size=4, num_kv_blocks=14, max_num_batched_tokens=16, tensor_parallel_size=2)
    try:
        if inspect is not None:
            inspect(llm)
        reference = hf_references(model_dir)
        assert run(llm) == reference  # chunked prefill, and preemption: 14 blocks of 4 cannot hold the batch
        assert llm.engine.scheduler.num_preemptions > 0
        assert run(llm) == reference  # again, the prompts' blocks now cached
        assert llm.engine.block_manager.prefix_hits > 0
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_gemma3_multimodal_checkpoint_serves_its_text_model(tp_dirs, tmp_path):
    from kubeinfer.dev.testing.random_model import save_gemma3_multimodal

    text_dir = tp_dirs("gemma3")
    save_gemma3_multimodal(text_dir, tmp_path / "mm")
    llm = LLM(str(tmp_path / "mm"), block_size=4, tensor_parallel_size=2)
    try:
        assert run(llm) == hf_references(text_dir)
    finally:
        llm.shutdown()


def test_each_rank_holds_its_own_kv_heads_and_a_dead_rank_fails_the_engine(tp_dirs):
    """The KV budget is per rank: with the same bytes, two ranks holding half the heads hold twice the blocks.
    Then rank 1 dies: the next step fails for good, naming it (the engine dies; a server exits non-zero)."""
    from kubeinfer.engine.core.errors import StepFailedError, is_unrecoverable

    one = LLM(tp_dirs("qwen2"), block_size=4, kv_cache_memory_bytes=1 << 20).engine
    two = LLM(tp_dirs("qwen2"), block_size=4, kv_cache_memory_bytes=1 << 20, tensor_parallel_size=2)
    try:
        assert two.engine.num_kv_blocks == 2 * one.num_kv_blocks
        assert two.engine.runner.kv_caches[0][0].shape[2] == one.spec.num_kv_heads // 2
        [rank1] = two.engine.ranks.processes
        rank1.kill()
        rank1.join(timeout=10)
        with pytest.raises(StepFailedError) as failure:
            two.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))
        assert is_unrecoverable(failure.value.cause)
        assert "tensor-parallel rank 1 is gone (exit code -9)" in str(failure.value.cause)
    finally:
        two.shutdown()


def test_lora_outputs_equal_peft(lora_base_dir, lora_adapters, lora_base_reference):
    """A and B cut like the layers they modify; one slot, so adapters are swapped in on every rank mid-batch."""
    prompts, loras, expected = mixed_batch(lora_adapters, lora_base_reference)
    llm = LLM(str(lora_base_dir), enable_lora=True, max_loras=1, max_lora_rank=8, block_size=4, tensor_parallel_size=2)
    try:
        params = [SamplingParams(temperature=0, max_tokens=LORA_MAX_TOKENS, ignore_eos=True)] * len(prompts)
        outputs = llm.generate(prompts, params, lora_request=loras)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        llm.shutdown()


def test_heads_that_do_not_divide_are_refused_by_name(tp_dirs):
    with pytest.raises(ValueError, match=r"number of attention heads \(4\) is not divisible by the tensor parallel "
                                         r"size \(3\)"):
        LLM(tp_dirs("qwen2"), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="async_scheduling is not supported with tensor parallelism"):
        LLM(tp_dirs("qwen2"), tensor_parallel_size=2, async_scheduling=True)


@pytest.mark.slow
def test_two_nodes_on_loopback_give_the_same_tokens(tp_dirs, monkeypatch):
    """Node 1 runs `kubeinfer serve --headless`; node 0 (here) is rank 0: one rank per node, TP over both
    (`--tensor-parallel-size` counts the whole group, as vLLM's does). Both read the group's secret from the
    environment (the operator's Secret); without it, both refuse to start."""
    model_dir, port = tp_dirs("qwen2"), free_port()
    monkeypatch.delenv("KUBEINFER_TP_SECRET", raising=False)
    two_nodes = dict(tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port)
    with pytest.raises(ValueError, match="KUBEINFER_TP_SECRET is not set"):
        LLM(model_dir, block_size=4, **two_nodes)
    headless = subprocess.run([sys.executable, "-m", "kubeinfer.cli", "serve", model_dir, "--headless", "--nnodes",
                               "2", "--node-rank", "1", "--master-port", str(port), "--tensor-parallel-size", "2"],
                              capture_output=True, text=True, timeout=120)
    assert headless.returncode != 0 and "KUBEINFER_TP_SECRET is not set" in headless.stderr
    monkeypatch.setenv("KUBEINFER_TP_SECRET", "0123456789abcdef" * 4)
    follower = subprocess.Popen([sys.executable, "-m", "kubeinfer.cli", "serve", model_dir, "--headless",
                                 "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                                 "--master-port", str(port), "--tensor-parallel-size", "2"])
    try:
        llm = LLM(model_dir, block_size=4, **two_nodes)
        try:
            assert run(llm) == hf_references(model_dir)
        finally:
            llm.shutdown()
        assert follower.wait(timeout=30) == 0  # told to stop: a clean end
    finally:
        if follower.poll() is None:
            follower.kill()


def test_one_rank_runs_no_collective_and_no_process(tp_dirs):
    """TP=1 is the single-device engine: plain modules' products, no group, no other process."""
    import multiprocessing

    import torch.distributed as dist

    llm = LLM(tp_dirs("qwen2"), block_size=4)
    assert llm.engine.ranks is None and llm.engine.runner.ranks is None
    assert not dist.is_initialized() and not multiprocessing.active_children()
    assert all(getattr(m, "tp_size", 1) == 1 for m in llm.engine.runner.model.modules())


@pytest.mark.slow
def test_a_rank_that_stops_answering_fails_the_step_after_the_timeout(tp_dirs):
    import os
    import signal

    from kubeinfer.engine.core.errors import StepFailedError, is_unrecoverable

    llm = LLM(tp_dirs("qwen2"), block_size=4, tensor_parallel_size=2, distributed_timeout=5)
    [rank1] = llm.engine.ranks.processes
    try:
        os.kill(rank1.pid, signal.SIGSTOP)
        with pytest.raises(StepFailedError) as failure:
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))
        assert is_unrecoverable(failure.value.cause)
    finally:
        rank1.kill()
        llm.shutdown()


@pytest.mark.slow  # ~90 s: the Triton attention kernels in Triton's CPU interpreter
def test_decode_graphs_on_every_rank_keep_outputs_exact(tp_dirs):
    """The CUDA-graph path per rank (each rank captures its own, collectives inside), with the CPU's stand-in for
    capture (test_cuda_graphs.py): decode steps replay every rank's static buffers; rank 1 returns its vocabulary
    slice into buffers of that width, rank 0 the gathered logits."""
    from kubeinfer.engine.platforms.cuda.cuda_graphs import replay_eagerly

    llm = LLM(tp_dirs("gemma3"), block_size=4, max_num_seqs=8, tensor_parallel_size=2, attention_backend="triton")
    try:
        llm.engine.ranks.send(("graphs", 8, True))
        llm.engine.runner.capture_decode_graphs(8, capture=replay_eagerly)
        replays = []
        run_graph = llm.engine.runner.graphs.run
        llm.engine.runner.graphs.run = lambda *a: replays.append(1) or run_graph(*a)
        assert run(llm) == hf_references(tp_dirs("gemma3"))
        assert replays  # decode steps went through the graphs
    finally:
        llm.shutdown()
