"""n-gram speculation against none at batch 1 on a looping model (issue #47): a random-init 8-layer Llama, hidden
512, intermediate 2048, vocabulary 32000, whose greedy output falls into a loop the n-gram proposer then predicts.
Same process, interleaved rounds, each system's best round counts; the CPU flags are printed with the figures.

    python benchmarks/bench_spec_batch1.py [--tokens 256] [--k 4] [--rounds 5] [--weights float32|w8a16] [--generic]

Systems: "off" (no speculation), "ngram" (as configured: the verify step on the native decode path where the
model qualifies) and, with --generic, "ngram, generic verify" (the model runner's `native_verify` off: the verify
step as one chunked-prefill query, and no batch-1 switch on step costs: the engine before this change)."""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import torch  # noqa: E402
from quant_checkpoints import ct_compress, ct_scheme, float_weights, write_checkpoint  # noqa: E402

from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402
from kubeinfer.engine import LLM, SamplingParams  # noqa: E402

FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            line = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    have = set(line.split(":", 1)[1].split())
    return " ".join(flag for flag in FLAGS if flag in have) or "none of " + " ".join(FLAGS)


def build(directory: Path, weights: str) -> str:
    """The float32 model, or its W8A16 checkpoint (per channel, symmetric; lm_head float): its layers then run a
    decode step in one native call each (platforms/cpu/native_decode.py) with KUBEINFER_QUANT_KERNEL=cpu_int8_a16."""
    if not (directory / "config.json").exists():
        build_random_model(directory, "llama", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8,
                           intermediate_size=2048, vocab_size=32000, max_position_embeddings=1024,
                           initializer_range=0.02, tokenizer=False, seed=7)
    if weights == "float32":
        return str(directory)
    quantized = directory.with_name(directory.name + "-w8a16")
    if not (quantized / "config.json").exists():
        config = ct_scheme("pack-quantized", 8, "int", "channel", True, None)
        write_checkpoint(directory, quantized, ct_compress(float_weights(directory), config), config)
    os.environ["KUBEINFER_QUANT_KERNEL"] = "cpu_int8_a16"
    return str(quantized)


def run(llm: LLM, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    gc.collect()
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return time.perf_counter() - start, out[0].outputs[0].token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--generic", action="store_true", help="also the verify step on the generic path")
    parser.add_argument("--weights", choices=("float32", "w8a16"), default="float32")
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "kubeinfer-spec-loop-model"))
    args = parser.parse_args()
    model = build(Path(args.model_dir), args.weights)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    engines = {"off": LLM(model, max_model_len=1024), "ngram": LLM(model, max_model_len=1024, speculative_config=ngram)}
    if args.generic:
        engines["ngram, generic verify"] = LLM(model, max_model_len=1024, speculative_config=ngram)
        engines["ngram, generic verify"].engine.runner.native_verify = False
        engines["ngram, generic verify"].engine.speculator.costs = None  # as before: no batch-1 switch either
    prompt = [101, 102, 103, 104, 105, 106, 107, 108] * 4  # a looping prompt
    print(f"CPU flags: {cpu_flags()}; torch threads {torch.get_num_threads()}; {args.weights}, {args.tokens} tokens, "
          f"k={args.k}, best of {args.rounds} interleaved rounds", flush=True)
    outputs, best = {}, {}
    for name, llm in engines.items():  # warm-up, and the outputs compared
        _, outputs[name] = run(llm, prompt, args.tokens)
    for name, ids in outputs.items():
        if ids != outputs["off"]:
            raise SystemExit(f"{name}: greedy output differs from no speculation")
    names = list(engines)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds, ids = run(engines[name], prompt, args.tokens)
            best[name] = max(best.get(name, 0.0), len(ids) / seconds)
    off = best["off"]
    for name, llm in engines.items():
        s = llm.engine.speculator
        rate = f", acceptance {s.acceptance_rate:.0%}" if s else ""
        if s and s.costs is not None and s.costs.plain.count:  # the batch-1 switch's own measurements (last values)
            rate += (f"; measured steps: plain {1e3 * s.costs.plain.value:.2f} ms, verify "
                     f"{1e3 * s.costs.verify.value:.2f} ms for {s.costs.tokens.value:.2f} tokens, switched off "
                     f"{s.costs.times_off}x")
        print(f"{name}: {best[name]:.1f} tok/s ({best[name] / off:.2f}x of off){rate}", flush=True)


if __name__ == "__main__":
    main()
