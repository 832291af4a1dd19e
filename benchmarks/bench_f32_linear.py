"""Per-call times of float32 `x @ w.T` at small batches: the native product (cpu_native/f32_linear.c, the pool's
threads) against what the engine runs today in a small step (OpenBLAS through numpy, every core; torch on one
thread, cpu_blas.py) and torch's F.linear on its own threads; the large benchmark model's shapes (lm_head
[16384, 1024] and the layers' qkv / o / gate_up / down). Interleaved: each round times every variant once, in
an order rotated round to round; best and median round, microseconds per call.

    python benchmarks/bench_f32_linear.py [--batches 1,16] [--calls 50] [--rounds 7]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # as the engine's benchmarks: before numpy loads OpenBLAS
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kubeinfer.engine.model_executor.layers.quantization.cpu_native import f32_ops  # noqa: E402

SHAPES = {"lm_head": (16384, 1024), "qkv": (2048, 1024), "o": (1024, 1024), "gate_up": (8192, 1024),
          "down": (1024, 4096)}


def variants(x: torch.Tensor, w: torch.Tensor) -> dict:
    wt = w.numpy().T
    threads = torch.get_num_threads()

    def torch_one():
        torch.set_num_threads(1)
        try:
            return F.linear(x, w)
        finally:
            torch.set_num_threads(threads)
    return {"native": lambda: f32_ops.f32_linear(x, w), "openblas": lambda: np.matmul(x.numpy(), wt),
            "torch 1 thread": torch_one, "torch F.linear": lambda: F.linear(x, w)}


def measure(batch: int, shape: tuple[int, int], calls: int, rounds: int) -> dict[str, list[float]]:
    n, k = shape
    x, w = torch.randn(batch, k), torch.randn(n, k)
    runs = variants(x, w)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            for _ in range(calls):
                runs[name]()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    print(f"# {platform.node()} {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"load before {os.getloadavg()[0]:.2f}")
    print("| batch | product [N, K] | native | OpenBLAS | torch 1 thread | torch F.linear | OpenBLAS / native |")
    print("|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        for name in args.shapes.split(","):
            t = measure(batch, SHAPES[name], args.calls, args.rounds)
            cell = {v: f"{min(s):.0f} ({statistics.median(s):.0f})" for v, s in t.items()}
            ratio = statistics.median(t["openblas"]) / statistics.median(t["native"])
            print(f"| {batch} | {name} {list(SHAPES[name])} | {cell['native']} | {cell['openblas']} | "
                  f"{cell['torch 1 thread']} | {cell['torch F.linear']} | {ratio:.2f}x |", flush=True)
    print(f"# load after {os.getloadavg()[0]:.2f}; us per call, best (median) of the rounds")


if __name__ == "__main__":
    main()
