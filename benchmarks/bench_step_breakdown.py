"""Where a decode step's time goes, at batch 1, 16 and 64: scheduling, input preparation, forward,
sampling, output processing (token append, detokenization, stop checks) and delivery (RequestOutputs).

Drives `LLMEngine.step` on the throughput benchmark's model (MODEL_SHAPE, with a tokenizer, so that
detokenization runs) with the engine's own step timer on (model_executor/step_timer.py: the same split
the engine logs at DEBUG on `kubeinfer.engine.step_profile`). Only steps where every sequence decodes
one token count. Each batch size runs --repeats times, the sizes interleaved; the repeat with the
fastest mean step is reported. Results go to benchmarks/RESULTS.md (section `step-breakdown`, or
`--key` to keep a "before" and an "after" side by side).

    python benchmarks/bench_step_breakdown.py [--tokens 128] [--repeats 3] [--dtype float32] [--key K]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from bench_throughput import MODEL_SHAPE  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.engine import LLM, SamplingParams  # noqa: E402
from kubeinfer.engine.model_executor.step_timer import PHASES  # noqa: E402
from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402

BATCH_SIZES = (1, 16, 64)
PROMPT_LEN = 32


def model_dir() -> Path:
    path = Path(".cache/bench-llama-33m-tok")  # bench_throughput's shape, plus a (512-token) tokenizer
    if not (path / "config.json").exists():
        build_random_model(path, "llama", tokenizer=True, initializer_range=0.02, **MODEL_SHAPE)
    return path


def run_batch(engine, batch: int, tokens: int, tag: str) -> dict[str, float]:
    """Mean seconds per phase over the all-decode steps of `batch` requests generating `tokens` each."""
    timer = engine.step_timer
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(10, MODEL_SHAPE["vocab_size"], (PROMPT_LEN,), generator=gen).tolist()
        engine.add_request(f"{tag}-{i}", prompt, params)
    timer.records.clear()
    while engine.has_unfinished_requests():
        engine.step()
    timer.finish()
    steps = [phases for num_seqs, decode, phases in timer.records if decode and num_seqs == batch]
    return {p: sum(s.get(p, 0.0) for s in steps) / len(steps) for p in PHASES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=3, help="runs per batch size (the fastest is reported)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--key", default="step-breakdown", help="RESULTS.md section to write")
    parser.add_argument("--title", default="Decode step breakdown (CPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--async-output-processing", choices=("auto", "on", "off"), default="auto",
                        help="deferred text (default: the engine's, on with CUDA): its work shows as `text`")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    deferred = {"auto": None, "on": True, "off": False}[args.async_output_processing]
    llm = LLM(str(model_dir()), max_num_seqs=max(args.batches), enable_prefix_caching=False, dtype=args.dtype,
              async_output_processing=deferred)
    engine = llm.engine
    engine.step_timer.enabled = engine.step_timer.keep_records = True
    run_batch(engine, 4, 8, "warm-up")
    best: dict[int, dict[str, float]] = {}
    for r in range(args.repeats):
        for batch in args.batches:
            split = run_batch(engine, batch, args.tokens, f"r{r}-b{batch}")
            if batch not in best or sum(split.values()) < sum(best[batch].values()):
                best[batch] = split
            print(f"repeat {r} batch {batch:3d}: {1000 * sum(split.values()):.2f} ms/step")

    header = "| batch | " + " | ".join(PHASES) + " | step ms | tok/s | host (not forward) |"
    table = [header, "|" + "---|" * (len(PHASES) + 4)]
    for batch, split in best.items():
        total = sum(split.values())
        table.append(f"| {batch} | " + " | ".join(f"{1000 * split[p]:.3f}" for p in PHASES)
                     + f" | {1000 * total:.2f} | {batch / total:.0f} | {1 - split['forward'] / total:.0%} |")
    print("\n".join(table))
    if args.no_write:
        return
    body = "\n".join([
        f"Command: `python benchmarks/bench_step_breakdown.py --tokens {args.tokens} --repeats {args.repeats} "
        f"--dtype {args.dtype}" + (f" --threads {args.threads}" if args.threads else "")
        + (f" --async-output-processing {args.async_output_processing}" if deferred is not None else "")
        + f"`. Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.dtype}.",
        (f"Model: bench_throughput's MODEL_SHAPE with a 512-token tokenizer; each batch is that many requests with "
         f"{PROMPT_LEN}-token prompts and {args.tokens} greedy tokens. Milliseconds per all-decode step, mean over "
         f"the steps of a run, fastest of {args.repeats} interleaved runs. Phases as the engine's step timer "
         "(model_executor/step_timer.py) charges them: `prepare` is host lists plus input tensors, `outputs` "
         "token append + detokenize + stop checks, `deliver` building the RequestOutputs; `text` is the "
         "previous step's deferred text work (detokenize, outputs, hand-off) when deferred text is on."),
        "", *table])
    update_results(args.key, args.title, body)


if __name__ == "__main__":
    main()
