"""Speculative decoding (n-gram) against no speculation, same engine, same model, same run.

* batch 1: decode tokens/s on copy-heavy prompts and on prompts that do not copy. A random-init model
  copies only what its own greedy decoding repeats, so a copy-heavy prompt is built from the model's
  output: a random prefix P is continued greedily to G, and the prompt is P + G + P (the document, then
  its beginning again): if the model continues as it did, the continuation is in the prompt. The
  acceptance rate says how far that held.
* batch 8 and 32: throughput of a mixed workload (half copy-heavy) without speculation, with it always
  on, and with the adaptive switch (`disable_by_batch_size`), with acceptance rates.

    python benchmarks/bench_spec_decode.py [--tokens 96] [--prompts 3] [--k 4]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from bench_throughput import MODEL_SHAPE  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.engine import LLM, SamplingParams  # noqa: E402
from kubeinfer.testing.random_model import build_random_model  # noqa: E402

MODEL_DIR = Path(__file__).parents[1] / ".cache" / "bench-llama-33m"


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def plain_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 8000) for _ in range(length)] for _ in range(count)]


def copy_prompts(llm: LLM, count: int, tokens: int, seed: int) -> list[list[int]]:
    prefixes = plain_prompts(count, 32, seed)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prefixes], greedy(tokens + 32))
    return [p + o.outputs[0].token_ids + p for p, o in zip(prefixes, outputs)]


def run(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, int]:
    """(seconds, output tokens) of one generate call over all prompts at once."""
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(tokens))
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def acceptance(llm: LLM, before: tuple[int, int]) -> float:
    s = llm.engine.speculator
    drafted, accepted = s.num_draft_tokens - before[0], s.num_accepted_tokens - before[1]
    return accepted / drafted if drafted else 0.0


def counters(llm: LLM) -> tuple[int, int]:
    s = llm.engine.speculator
    return (s.num_draft_tokens, s.num_accepted_tokens) if s else (0, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=96, help="output tokens per request")
    parser.add_argument("--prompts", type=int, default=3, help="prompts of each kind at batch 1")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--batches", default="8,32")
    args = parser.parse_args()
    if not (MODEL_DIR / "config.json").exists():
        build_random_model(MODEL_DIR, "llama", tokenizer=False, initializer_range=0.02, **MODEL_SHAPE)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    batches = [int(b) for b in args.batches.split(",")]
    adaptive_limit = 16
    engines = {"off": LLM(str(MODEL_DIR), max_model_len=1024),
               "ngram": LLM(str(MODEL_DIR), max_model_len=1024, speculative_config=ngram),
               "ngram, adaptive": LLM(str(MODEL_DIR), max_model_len=1024,
                                      speculative_config={**ngram, "disable_by_batch_size": adaptive_limit})}
    kinds = {"copy-heavy": copy_prompts(engines["off"], max(args.prompts, max(batches) // 2), args.tokens, seed=1),
             "no copying": plain_prompts(max(args.prompts, max(batches)), 96, seed=2)}
    lengths = ", ".join(f"{k} {sum(map(len, v)) // len(v)}" for k, v in kinds.items())
    print(f"torch threads {torch.get_num_threads()}; mean prompt lengths: {lengths}")
    for llm in engines.values():  # warm up
        run(llm, kinds["no copying"][:1], 8)

    rows = ["| prompts | tokens/s, no speculation | tokens/s, n-gram | speed-up | acceptance |", "|---|---|---|---|---|"]
    for kind, prompts in kinds.items():
        speed, accepted = {}, 0.0
        for name in ("off", "ngram"):
            llm, seconds, produced = engines[name], 0.0, 0
            before = counters(llm)
            for prompt in prompts[:args.prompts]:  # one at a time: batch 1
                s, n = run(llm, [prompt], args.tokens)
                seconds, produced = seconds + s, produced + n
            speed[name] = produced / seconds
            if name == "ngram":
                accepted = acceptance(llm, before)
        rows.append(f"| {kind} | {speed['off']:.1f} | {speed['ngram']:.1f} | {speed['ngram'] / speed['off']:.2f}x "
                    f"| {accepted:.0%} |")
        print(rows[-1])

    header = "| batch | tokens/s, no speculation | n-gram always | n-gram adaptive | adaptive vs none | acceptance |"
    table = [header, "|---|---|---|---|---|---|"]
    for batch in batches:
        mixed = kinds["copy-heavy"][:batch // 2] + kinds["no copying"][:batch - batch // 2]
        speed, accepted = {}, 0.0
        for name, llm in engines.items():
            before = counters(llm)
            seconds, produced = run(llm, mixed, args.tokens)
            speed[name] = produced / seconds
            if name == "ngram":
                accepted = acceptance(llm, before)
        table.append(f"| {batch} | {speed['off']:.1f} | {speed['ngram']:.1f} | {speed['ngram, adaptive']:.1f} | "
                     f"{speed['ngram, adaptive'] / speed['off']:.2f}x | {accepted:.0%} |")
        print(table[-1])

    command = (f"python benchmarks/bench_spec_decode.py --tokens {args.tokens} --prompts {args.prompts} --k {args.k} "
               f"--batches {args.batches}")
    update_results("spec-decode", "Speculative decoding (n-gram) vs none", (
        f"`{command}` on the random-init 33M llama of bench_throughput (CPU, {torch.get_num_threads()} torch threads, "
        f"greedy, {args.tokens} output tokens per request, num_speculative_tokens={args.k}). Copy-heavy prompts are "
        "P + G + P with G the model's own greedy continuation of P; the others are random tokens. Batch 1, one "
        "request at a time:\n\n" + "\n".join(rows) + f"\n\nMixed batches (half copy-heavy); adaptive turns "
        f"speculation off from {adaptive_limit} requests (`disable_by_batch_size`):\n\n" + "\n".join(table) +
        "\n\nVerification runs eagerly (as a chunked-prefill query of 1 + k tokens), also on a GPU: no CUDA graph "
        "for it yet. This machine is shared and noisy; compare rows of one run."))


if __name__ == "__main__":
    main()
