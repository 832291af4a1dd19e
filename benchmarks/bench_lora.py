"""The cost of batched multi-LoRA: one batch mixing 4 adapters vs the same batch on the base model alone,
and vs serving the adapters one after another (one adapter's requests at a time, as a deployment with
one merged model per adapter, or an engine that cannot mix adapters in a batch, would).

Same random-init model, same requests (prompt and output lengths varying several-fold), greedy.
Adapters are rank 16 on all seven projections (the heaviest common setup). Results go to
benchmarks/RESULTS.md.

    python benchmarks/bench_lora.py [--requests 64]   # `make bench` runs it
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
from bench_throughput import MODEL_SHAPE, workload  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from kubeinfer.dev.testing.random_model import build_random_adapter, build_random_model  # noqa: E402

NUM_ADAPTERS, RANK = 4, 16


def timed_generate(llm: LLM, work, loras) -> float:
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in work],
                           [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work],
                           lora_request=loras)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in work]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)

    cache = Path(".cache")
    model_dir = cache / "bench-llama-33m"
    if not (model_dir / "config.json").exists():
        build_random_model(model_dir, "llama", tokenizer=False, initializer_range=0.02, **MODEL_SHAPE)
    adapters = [LoRARequest(f"adapter-{i}", i + 1, str(build_random_adapter(cache / f"bench-lora-{i}", model_dir,
                                                                              rank=RANK, seed=i)))
                for i in range(NUM_ADAPTERS)]
    work = workload(args.requests, seed=1)
    routed = [adapters[i % NUM_ADAPTERS] for i in range(len(work))]  # round-robin: every batch mixes all 4
    useful = sum(n for _, n in work)
    llm = LLM(str(model_dir), max_num_seqs=args.max_num_seqs, enable_lora=True, max_loras=NUM_ADAPTERS,
              max_lora_rank=RANK, enable_prefix_caching=False)
    timed_generate(llm, work[:NUM_ADAPTERS], adapters)  # warm-up, and reads every adapter once

    base_s = timed_generate(llm, work, None)
    print(f"base model alone          {base_s:7.2f} s  {useful / base_s:8.1f} tok/s")
    mixed_s = timed_generate(llm, work, routed)
    print(f"4 adapters, one batch     {mixed_s:7.2f} s  {useful / mixed_s:8.1f} tok/s")
    serial_s = 0.0
    for adapter in adapters:
        mine = [i for i, a in enumerate(routed) if a is adapter]
        serial_s += timed_generate(llm, [work[i] for i in mine], adapter)
    print(f"4 adapters, one at a time {serial_s:7.2f} s  {useful / serial_s:8.1f} tok/s")

    rows = [("base model alone", base_s, "no adapter"),
            ("4 adapters mixed in one batch", mixed_s, "batched multi-LoRA, round-robin routing"),
            ("4 adapters one after another", serial_s, f"each adapter's {args.requests // NUM_ADAPTERS} requests alone")]
    table = ["| run | time (s) | output tok/s | throughput vs mixed batch |", "|---|---|---|---|"]
    table += [f"| {name} | {s:.2f} | {useful / s:.1f} | {mixed_s / s:.2f}x |" for name, s, _ in rows]
    body = "\n".join([
        f"Command: `python benchmarks/bench_lora.py --requests {args.requests}` (`make bench`). Machine: "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        "float32.",
        f"Model: the random-init Llama of the throughput benchmark ({MODEL_SHAPE['num_layers']} layers, hidden "
        f"{MODEL_SHAPE['hidden_size']}); {NUM_ADAPTERS} adapters of rank {RANK} on q/k/v/o/gate/up/down, "
        f"max_loras={NUM_ADAPTERS}. Workload: {args.requests} requests, prompts 16-256 tokens, outputs 16-128 "
        f"({useful} output tokens), greedy, all submitted at once, prefix caching off.",
        "", *table, "",
        f"Cost of LoRA: the mixed batch runs at {base_s / mixed_s:.2f}x the base model's throughput. Mixing beats "
        f"serving the adapters one after another by {serial_s / mixed_s:.2f}x: the batches stay full."])
    update_results("lora-throughput", "Batched multi-LoRA throughput (CPU)", body)


if __name__ == "__main__":
    main()
