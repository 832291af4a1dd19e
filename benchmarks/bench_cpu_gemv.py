"""Which CPU matmul path is fastest for the decode step's projections (issue 21).

For each projection shape of the benchmark model (fused q/k/v, o, fused gate/up, down, lm_head) and
1, 16 and 64 tokens, times `F.linear` with the weight as the checkpoint stores it (row-major [out, in]),
with the same weight stored column-major, and, in float32, MKL's pre-packed GEMM
(`torch.ops.mkl._mkl_linear`, what inductor's freezing uses; it needs a second copy of the weights) and
numpy's OpenBLAS with torch on one thread (what the engine's decode steps use on the CPU:
platforms/cpu/cpu_blas.py).
Weights are cycled through copies larger than the caches, so every product streams from memory as a
decode step does. Results go to benchmarks/RESULTS.md (section `cpu-gemv`).

    python benchmarks/bench_cpu_gemv.py [--threads N]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_throughput import MODEL_SHAPE  # noqa: E402
from results import update_results  # noqa: E402

COLD_BYTES = 64 << 20  # more than this machine's caches


def shapes() -> dict[str, tuple[int, int]]:
    s = MODEL_SHAPE
    head_dim = s["hidden_size"] // s["num_heads"]
    qkv = (s["num_heads"] + 2 * s["num_kv_heads"]) * head_dim
    return {"qkv_proj": (qkv, s["hidden_size"]), "o_proj": (s["hidden_size"], s["num_heads"] * head_dim),
            "gate_up_proj": (2 * s["intermediate_size"], s["hidden_size"]),
            "down_proj": (s["hidden_size"], s["intermediate_size"]), "lm_head": (s["vocab_size"], s["hidden_size"])}


def seconds_per_product(fn, weights, repeats: int = 7) -> float:
    for w in weights:
        fn(w)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def measure(dtype: torch.dtype, tokens: int) -> dict[str, dict[str, float]]:
    out = {}
    for name, (rows, cols) in shapes().items():
        element = torch.empty((), dtype=dtype).element_size()
        weights = [torch.randn(rows, cols, dtype=dtype) for _ in range(max(1, COLD_BYTES // (rows * cols * element)))]
        column_major = [w.t().contiguous().t() for w in weights]
        x = torch.randn(tokens, cols, dtype=dtype)
        with torch.inference_mode():
            times = {"row-major": seconds_per_product(lambda w, x=x: F.linear(x, w), weights),
                     "column-major": seconds_per_product(lambda w, x=x: F.linear(x, w), column_major)}
            if dtype == torch.float32 and torch.backends.mkl.is_available():
                packed = {id(w): torch.ops.mkl._mkl_reorder_linear_weight(w, tokens) for w in weights}
                times["mkl packed"] = seconds_per_product(
                    lambda w, x=x, p=packed: torch.ops.mkl._mkl_linear(x, p[id(w)], w, None, tokens), weights)
        if dtype == torch.float32:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as in the engine's decode steps: OpenBLAS has the cores
            arrays, xn = [w.numpy() for w in weights], x.numpy()
            times["openblas (numpy)"] = seconds_per_product(lambda w, xn=xn: np.matmul(xn, w.T), arrays)
            torch.set_num_threads(threads)
        out[name] = times
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lines = ["| dtype | tokens | layout | " + " | ".join(shapes()) + " | one step's products (ms) |",
             "|---|---|---|" + "---|" * (len(shapes()) + 1)]
    for dtype in (torch.float32, torch.bfloat16):
        for tokens in (1, 16, 64):
            result = measure(dtype, tokens)
            for layout in result["qkv_proj"]:  # (a layout or a library)
                per = {name: result[name][layout] for name in result}
                step = MODEL_SHAPE["num_layers"] * (sum(per.values()) - per["lm_head"]) + per["lm_head"]
                lines.append(f"| {str(dtype).removeprefix('torch.')} | {tokens} | {layout} | "
                             + " | ".join(f"{1e6 * t:.0f} us" for t in per.values()) + f" | {1e3 * step:.2f} |")
                print(lines[-1])
    if args.no_write:
        return
    body = "\n".join([
        "Command: `python benchmarks/bench_cpu_gemv.py" + (f" --threads {args.threads}" if args.threads else "")
        + f"`. Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, MKL {torch.backends.mkl.is_available()}, oneDNN "
        f"{torch.backends.mkldnn.is_available()}.",
        ("Time of one `F.linear` per projection of the benchmark model (weights cold, best of 7); the last column "
         "is a whole decode step's products (layers x per-layer + lm_head)."), "", *lines])
    update_results("cpu-gemv", "CPU matmul paths for the decode projections", body)


if __name__ == "__main__":
    main()
