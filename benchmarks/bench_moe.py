"""Mixture of experts on the CPU: offline throughput of a small Qwen3-MoE-shaped model, kubeinfer's engine vs
transformers `generate` and transformers' continuous batching in the same run (the rules and runners of
bench_throughput.py), and the MoE layers' share of a decode step at batch 1 and 32 (the time inside the
sparse blocks, router included, over the whole forward pass, decode-only steps).

    python benchmarks/bench_moe.py [--requests 32] [--hf-batch 16] [--repeats 2] [--dtype float32]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from bench_throughput import (  # noqa: E402
    EngineRunner,
    HFContinuousRunner,
    HFGenerateRunner,
    has_continuous_batching,
    passes_line,
    results_table,
    run_rounds,
    workload,
)
from results import update_results  # noqa: E402

from kubeinfer.engine import LLM, SamplingParams  # noqa: E402
from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402

# Qwen3-30B-A3B's proportions shrunk: experts' intermediate size 3/8 of hidden, top-8 of 128 -> top-4 of 32.
MODEL_SHAPE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536,
                   vocab_size=8192, max_position_embeddings=1024, num_experts=32, num_experts_per_tok=4,
                   moe_intermediate_size=192)


def cpu_flags() -> str:
    """The vector extensions the kernels can use, from /proc/cpuinfo (empty where there is none)."""
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return ""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")
    return " ".join(w for w in wanted if w in words)


def moe_share(model_dir: str, batch: int, dtype: str, tokens: int = 48) -> tuple[float, float]:
    """(mean decode step in ms, share of it inside the sparse blocks) for `batch` sequences decoding together."""
    from kubeinfer.engine.model_executor.models.moe import SparseMoeBlock

    llm = LLM(model_dir, max_num_seqs=batch, enable_prefix_caching=False, dtype=dtype)
    model = llm.engine.runner.model
    spent = {"step": 0.0, "moe": 0.0, "steps": 0}
    inside = {"decode": False}
    block_forward, model_forward = SparseMoeBlock.forward, type(model).forward

    def timed_block(self, x, lora=None):
        start = time.perf_counter()
        out = block_forward(self, x, lora)
        if inside["decode"]:
            spent["moe"] += time.perf_counter() - start
        return out

    def timed_model(self, input_ids, positions, kv_caches, meta, *args, **kwargs):
        inside["decode"] = meta.num_decodes == meta.num_seqs == batch
        start = time.perf_counter()
        out = model_forward(self, input_ids, positions, kv_caches, meta, *args, **kwargs)
        if inside["decode"]:
            spent["step"] += time.perf_counter() - start
            spent["steps"] += 1
        return out

    SparseMoeBlock.forward, type(model).forward = timed_block, timed_model
    try:
        prompts = [{"prompt_token_ids": list(range(10 + i, 42 + i))} for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        llm.generate(prompts, params)  # warm-up
        spent.update(step=0.0, moe=0.0, steps=0)
        llm.generate(prompts, params)
    finally:
        SparseMoeBlock.forward, type(model).forward = block_forward, model_forward
    return 1000 * spent["step"] / max(spent["steps"], 1), spent["moe"] / spent["step"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/RESULTS.md alone")
    args = parser.parse_args()
    torch.manual_seed(0)

    model_dir = Path(".cache/bench-qwen3-moe")
    if not (model_dir / "config.json").exists():
        build_random_model(model_dir, "qwen3_moe", tokenizer=False, initializer_range=0.02, **MODEL_SHAPE)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    params = sum(p.numel() for p in hf.parameters())
    experts = MODEL_SHAPE["num_experts"]
    active = params - MODEL_SHAPE["num_layers"] * (experts - MODEL_SHAPE["num_experts_per_tok"]) * 3 * \
        MODEL_SHAPE["hidden_size"] * MODEL_SHAPE["moe_intermediate_size"]
    work = workload(args.requests)
    useful = sum(n for _, n in work)
    flags, load = cpu_flags(), os.getloadavg()[0]
    print(f"CPU flags: {flags}; load average {load:.1f}")
    print(f"model: {params / 1e6:.1f}M params ({active / 1e6:.1f}M active), {args.requests} requests, "
          f"{useful} output tokens; torch threads {torch.get_num_threads()}")

    runners = [EngineRunner(str(model_dir), work, args.max_num_seqs, args.dtype),
               HFGenerateRunner(hf, work, args.hf_batch)]
    if has_continuous_batching():
        runners.append(HFContinuousRunner(hf, work, args.max_num_seqs))
    times, others, generated = run_rounds(runners, args.repeats, useful)
    table = results_table(runners, times, generated, useful)
    print("\n".join(table))

    shares = ["| decode batch | step (ms) | in the MoE blocks (router + experts) |", "|---|---|---|"]
    for batch in (1, 32):
        step_ms, share = moe_share(str(model_dir), batch, args.dtype)
        shares.append(f"| {batch} | {step_ms:.1f} | {share:.0%} |")
        print(shares[-1])
    if args.no_write:
        return
    command = (f"python benchmarks/bench_moe.py --requests {args.requests} --hf-batch {args.hf_batch} "
               f"--repeats {args.repeats} --dtype {args.dtype}")
    body = "\n".join([
        f"Command: `{command}`. Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, CPU flags {flags}, load average {load:.1f} at the start "
        f"({os.getloadavg()[0]:.1f} at the end), transformers {__import__('transformers').__version__}, "
        f"{args.dtype} for all.",
        f"Model: random-init Qwen3-MoE, {params / 1e6:.1f}M parameters, {active / 1e6:.1f}M active per token "
        f"({MODEL_SHAPE['num_layers']} layers, hidden {MODEL_SHAPE['hidden_size']}, {experts} experts of "
        f"{MODEL_SHAPE['moe_intermediate_size']}, top-{MODEL_SHAPE['num_experts_per_tok']}: Qwen3-30B-A3B's "
        f"proportions shrunk). transformers runs its default experts implementation (a grouped matmul on the CPU). "
        f"Workload and rules as in the offline-throughput section: {args.requests} requests, prompts 16-256 tokens, "
        f"outputs 16-128 tokens ({useful} output tokens), one untimed warm-up pass, then {args.repeats} timed passes "
        "each in rotating order, each system's fastest pass.", "", *table, "",
        "Each timed pass in seconds (others' share of the CPU): " + passes_line(times, others) + ".", "",
        "The MoE layers' share of a decode step (the engine, decode-only steps after a 32-token prompt, 48 tokens; "
        "time inside the sparse blocks over the forward pass):", "", *shares])
    update_results("moe-throughput", "Mixture of experts: offline throughput and the MoE layers' share (CPU)", body)


if __name__ == "__main__":
    main()
