"""Offline throughput: kubeinfer's engine vs transformers on the same model and the same mixed workload.

Peers, measured in this run on this machine:
  * transformers `generate`, batched with left padding (every batch runs to its longest output);
  * transformers' own continuous batching, `generate_batch`, where this transformers has it.
Throughput counts only the tokens each request asked for. Results go to benchmarks/RESULTS.md.

    python benchmarks/bench_throughput.py [--requests 48] [--hf-batch 16]
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from results import update_results  # noqa: E402

from kubeinfer.engine import LLM, SamplingParams  # noqa: E402
from kubeinfer.testing.random_model import build_random_model  # noqa: E402

MODEL_SHAPE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536,
                   vocab_size=8192, max_position_embeddings=1024)


def workload(count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Prompt lengths 16-256 and output lengths 16-128: both vary several-fold, as real traffic does."""
    rng = random.Random(seed)
    return [([rng.randrange(10, 8000) for _ in range(rng.randint(16, 256))], rng.randint(16, 128)) for _ in range(count)]


def run_engine(model_dir: str, work, max_num_seqs: int, dtype: str) -> float:
    # No prefix caching: the timed pass must not reuse the warm-up's blocks.
    llm = LLM(model_dir, max_num_seqs=max_num_seqs, enable_prefix_caching=False, dtype=dtype)
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    # Warm-up on the whole workload: the first pass also pays for the first touch of the KV cache's pages.
    llm.generate(prompts, params)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in work]
    return elapsed


def run_hf_generate(model, work, batch_size: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        chunk = work[i:i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, (p, _) in enumerate(chunk):  # left padding, as decoder-only generation needs
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in chunk), do_sample=False,
                           eos_token_id=[], pad_token_id=0)
    return time.perf_counter() - start


def run_hf_generate_batch(model, work, max_num_seqs: int) -> float | None:
    try:
        from transformers import ContinuousBatchingConfig, GenerationConfig
    except ImportError:
        return None
    # generate_batch takes one generation config for all requests: give each its own max_new_tokens
    # is not possible, so run the longest and count only requested tokens (its cost is an upper bound).
    max_new = max(n for _, n in work)
    blocks = max_num_seqs * (256 + max_new) // 16 + 64
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=blocks, max_batch_tokens=2048)
    start = time.perf_counter()
    model.generate_batch([p for p, _ in work], generation_config=config, continuous_batching_config=cb)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=48)
    parser.add_argument("--skip-generate-batch", action="store_true")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="for the engine and transformers alike (bf16 pays on CPUs with AVX512-BF16 or AMX)")
    args = parser.parse_args()
    torch.manual_seed(0)

    model_dir = Path(".cache/bench-llama-33m")
    if not (model_dir / "config.json").exists():
        build_random_model(model_dir, "llama", tokenizer=False, initializer_range=0.02, **MODEL_SHAPE)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    params = sum(p.numel() for p in hf.parameters())
    work = workload(args.requests)
    useful = sum(n for _, n in work)
    print(f"model: {params / 1e6:.1f}M params, {args.requests} requests, {useful} output tokens, "
          f"{sum(len(p) for p, _ in work)} prompt tokens; torch threads {torch.get_num_threads()}")

    engine_s = run_engine(str(model_dir), work, args.max_num_seqs, args.dtype)
    print(f"kubeinfer engine          {engine_s:7.2f} s  {useful / engine_s:8.1f} tok/s")
    run_hf_generate(hf, [(work[0][0], 4)], 1)  # warm-up
    hf_s = run_hf_generate(hf, work, args.hf_batch)
    print(f"transformers generate     {hf_s:7.2f} s  {useful / hf_s:8.1f} tok/s   (batch {args.hf_batch}, padded)")
    cb_s = None if args.skip_generate_batch else run_hf_generate_batch(hf, work, args.max_num_seqs)
    if cb_s:
        print(f"transformers generate_batch {cb_s:5.2f} s  {useful / cb_s:8.1f} tok/s")

    rows = [("kubeinfer engine", engine_s, "continuous batching, chunked prefill, paged KV"),
            ("transformers `generate`", hf_s, f"static batches of {args.hf_batch}, left-padded")]
    if cb_s:
        rows.append(("transformers `generate_batch`", cb_s, "its continuous batching; one max_new_tokens for all"))
    table = ["| system | time (s) | output tok/s | engine speed-up | how |", "|---|---|---|---|---|"]
    table += [f"| {name} | {s:.2f} | {useful / s:.1f} | {s / engine_s:.2f}x | {how} |" for name, s, how in rows]
    body = "\n".join([
        f"Command: `python benchmarks/bench_throughput.py --requests {args.requests} --hf-batch {args.hf_batch} "
        f"--dtype {args.dtype}` (`make bench`). Machine: {platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, {args.dtype} for both.",
        f"Model: random-init Llama, {params / 1e6:.1f}M parameters ({MODEL_SHAPE['num_layers']} layers, hidden "
        f"{MODEL_SHAPE['hidden_size']}, GQA {MODEL_SHAPE['num_heads']}/{MODEL_SHAPE['num_kv_heads']} heads). "
        f"Workload: {args.requests} requests, prompts 16-256 tokens, outputs 16-128 tokens "
        f"({useful} output tokens in all), greedy, all submitted at once.",
        "", *table])
    if args.dtype == "float32":
        update_results("offline-throughput", "Offline throughput vs transformers (CPU)", body)
    else:
        update_results(f"offline-throughput-{args.dtype}", f"Offline throughput vs transformers (CPU, {args.dtype})",
                       body)


if __name__ == "__main__":
    main()
