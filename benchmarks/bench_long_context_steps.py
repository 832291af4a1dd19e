"""Decode steps over long contexts of a float32 model on the CPU: a decode step whose every layer's attention runs
in C stays a small step (torch on one thread, projections through OpenBLAS / the native float32 product) however
long the contexts (model_runner._openblas_step, native_decode.decode_attention_native). Before, only a model whose
every layer was in the fused native call did; a float32 model's per-module path left small-step mode past
cpu_blas.MAX_CONTEXT_TOKENS (4096 context tokens in a step) and torch's two threads spun against the native pool.

A/B in one process and one engine, rounds interleaved: `before` swaps the old predicate (all_layers_native) back in.
Batch 16, greedy, aggregate decode tokens/s (bench_quantized_decode.EngineSystem.rate)."""
from __future__ import annotations

import argparse
import os
import random
import statistics

import bench_quantized_decode as bqd
from results import update_results

from kubeinfer.engine.platforms.cpu import native_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="large", choices=list(bqd.MODELS))
    parser.add_argument("--prompt-len", default="32,256", help="prompt tokens per request, comma-separated")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    system = bqd.EngineSystem(bqd.checkpoints(args.model, "int8")["float32"], args.tokens)
    predicates = {"before": native_decode.all_layers_native, "after": native_decode.decode_attention_native}
    rows, loads = [], []
    rng = random.Random(0)
    for prompt_len in [int(n) for n in args.prompt_len.split(",")]:
        prompts = [[rng.randrange(100, 1000) for _ in range(prompt_len)] for _ in range(16)]
        rates = {which: [] for which in predicates}
        for _ in range(args.rounds):
            for which, predicate in predicates.items():
                native_decode.decode_attention_native = predicate
                rates[which].append(system.rate(prompts))
            loads.append(os.getloadavg()[0])
        native_decode.decode_attention_native = predicates["after"]
        best = {w: max(r) for w, r in rates.items()}
        median = {w: statistics.median(r) for w, r in rates.items()}
        rows.append(f"| {prompt_len} | {best['before']:.1f} / {median['before']:.1f} | {best['after']:.1f} / "
                    f"{median['after']:.1f} | {best['after'] / best['before']:.2f}x |")
        print(rows[-1], flush=True)
    title = "float32 model, batch-16 decode over long contexts: small steps (CPU)"
    update_results("long-context-f32-steps", title, "\n".join([
        f"Command: `python benchmarks/bench_long_context_steps.py --model {args.model} --prompt-len {args.prompt_len} "
        f"--tokens {args.tokens} --rounds {args.rounds}`; load average {min(loads):.1f}-{max(loads):.1f} on 2 cores. "
        "One engine, the predicates swapped round by round (module docstring).", "",
        "| prompt tokens | before tok/s (best / median) | after tok/s (best / median) | best ratio |",
        "|---|---|---|---|", *rows]))


if __name__ == "__main__":
    main()
