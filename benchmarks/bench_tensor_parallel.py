"""Tensor parallelism's per-step cost: decode steps of TP=2 against TP=1 on the same model and batch, and
the step hand-off alone (encoding a step's inputs with the channel's schema, distributed/wire.py, and sending
them to the other ranks).

On the CPU (gloo, 2 ranks sharing this machine's cores) TP cannot be faster: the ranks split the same cores
and add an all-reduce per layer; the figure to watch is the overhead per step. TP=1 runs with as many torch
threads as each TP rank gets (`--threads`, default: cores / TP), so that the two differ by the split and its
collectives, not by the threads (a loaded machine makes torch's spinning thread pool very slow otherwise).
On a machine with several GPUs (`--device cuda --tp N`, the `bench-gpu` case in docs/gpu.md), TP=N against
TP=1 is the real measure.

    python benchmarks/bench_tensor_parallel.py [--device cpu] [--tp 2] [--batches 1,32] [--steps 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from results import update_results  # noqa: E402

from kubeinfer.engine import LLM, SamplingParams  # noqa: E402
from kubeinfer.engine.core.tp_messages import check_message  # noqa: E402
from kubeinfer.engine.distributed import wire  # noqa: E402
from kubeinfer.engine.model_executor.step_inputs import StepInputs  # noqa: E402
from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402

SHAPE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536, vocab_size=8192)


def decode_step_ms(llm: LLM, batch: int, steps: int) -> float:
    """Median wall time of a decode step with `batch` sequences running."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}-{time.monotonic_ns()}", {"prompt_token_ids": [5 + i, 6, 7, 8]}, params)
    while engine.scheduler.waiting:  # prefills first
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3


def handoff_us(batch: int, repeat: int = 2000) -> float:
    """Encoding one decode step's inputs (what rank 0 sends each rank) and decoding them, both sides' checks
    included, per step."""
    inputs = StepInputs()
    for i in range(batch):
        inputs.add([7], 200 + i, list(range(i * 16, i * 16 + 15)), 16)
        inputs.logits_indices.append(i)
    inputs.num_decodes = batch
    start = time.perf_counter()
    for _ in range(repeat):
        check_message(wire.decode(wire.encode(check_message(("step", inputs, None)))))
    return (time.perf_counter() - start) / repeat * 1e6


def timed_sends(llm: LLM) -> list[float]:
    """Rank 0's hand-off of each message to the other ranks (encode and sendall), timed."""
    ranks, times = llm.engine.ranks, []
    send = ranks.send

    def timed(message):
        start = time.perf_counter()
        send(message)
        times.append(time.perf_counter() - start)
    ranks.send = timed
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", default=None, help="a model directory (default: a random one of SHAPE)")
    parser.add_argument("--threads", type=int, default=None, help="TP=1's torch threads (default: cores / --tp)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    model = args.model or str(build_random_model("/tmp/kubeinfer-bench-tp", "llama", tokenizer=False, **SHAPE))
    batches = [int(b) for b in args.batches.split(",")]
    rows, send_us = {}, {}
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.tp)
    for tp in (1, args.tp):
        if args.device == "cpu":
            torch.set_num_threads(threads)
        llm = LLM(model, device=args.device, tensor_parallel_size=tp, max_num_seqs=max(batches), block_size=16)
        sends = timed_sends(llm) if tp > 1 else None
        rows[tp] = {}
        for b in batches:
            if sends is not None:
                sends.clear()
            rows[tp][b] = decode_step_ms(llm, b, args.steps)
            if sends is not None:
                send_us[b] = statistics.median(sends) * 1e6
        llm.shutdown()
        del llm
    lines = [f"Decode step, median of {args.steps} ({args.device}, random llama {SHAPE}; TP=1 on {threads} "
             f"torch thread(s), each TP rank on its share of {os.cpu_count()} cores):", "",
             "| batch | TP=1 ms/step | TP=%d ms/step | TP=%d / TP=1 | rank 0's send, us/step | encode + decode, us |"
             % (args.tp, args.tp), "|---|---|---|---|---|---|"]
    for b in batches:
        lines.append(f"| {b} | {rows[1][b]:.2f} | {rows[args.tp][b]:.2f} | {rows[args.tp][b] / rows[1][b]:.2f} | "
                     f"{send_us[b]:.0f} | {handoff_us(b):.0f} |")
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        update_results("tensor_parallel", "Tensor parallelism: per-step cost",
                       body + "\n\n`python benchmarks/bench_tensor_parallel.py --device "
                       f"{args.device} --tp {args.tp} --batches {args.batches} --steps {args.steps}`")


if __name__ == "__main__":
    main()
