"""W8A8 int8 on the CPU: one layer's product with its input quantized per token (activations.py), by fake
quantization (quantize-dequantize the input, then F.linear with the dequantized weight: the reference's own
computation) against torch._int_mm (int8 x int8 -> int32, then both scales: activations.int8_linear), with
the unquantized F.linear beside them. Calls interleaved round by round, so the load on the shared machine
falls on all alike; the ratios are what the module docstring of activations.py cites.

    python benchmarks/bench_w8a8.py [--rounds 15]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from results import update_results  # noqa: E402

from kubeinfer.engine.model_executor.layers.quantization.activations import (  # noqa: E402
    ActivationScheme,
    fake_quantize,
    int8_linear,
)

OUT, COLS = 8192, 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    weight_q = torch.randint(-127, 128, (OUT, COLS), generator=gen, dtype=torch.int8)
    weight_scale = torch.rand(OUT, generator=gen) * 0.01
    weight = weight_q.float() * weight_scale[:, None]
    weight_t = weight_q.t().contiguous()
    scheme = ActivationScheme("int", "token", True)
    kernels = {"F.linear (float input)": lambda x: F.linear(x, weight),
               "fake quantization + F.linear": lambda x: F.linear(fake_quantize(x, scheme), weight),
               "torch._int_mm": lambda x: int8_linear(x, scheme, weight_t, weight_scale)}
    load = os.getloadavg()[0]
    lines = ["| tokens | " + " | ".join(f"{k} ms" for k in kernels) + " | _int_mm / fake quantization |",
             "|---|" + "---|" * (len(kernels) + 1)]
    for tokens in (1, 16, 64):
        x = torch.randn(tokens, COLS, generator=gen)
        times = {k: [] for k in kernels}
        for fn in kernels.values():
            fn(x)
        for _ in range(args.rounds):
            for name, fn in kernels.items():
                start = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - start)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        ratio = med["torch._int_mm"] / med["fake quantization + F.linear"]
        print(tokens, {k: round(v, 2) for k, v in med.items()}, f"ratio {ratio:.2f}")
        lines.append(f"| {tokens} | " + " | ".join(f"{v:.2f}" for v in med.values()) + f" | {ratio:.2f} |")
    body = "\n".join([f"Command: `python benchmarks/bench_w8a8.py --rounds {args.rounds}`. Machine: "
                      f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs (load average "
                      f"{load:.1f} at the start), torch {torch.__version__}, {torch.get_num_threads()} threads. One "
                      f"[tokens, {COLS}] x [{OUT}, {COLS}] float32 product, int8 input per token; medians of "
                      f"{args.rounds} interleaved rounds.", "", *lines])
    update_results("w8a8", "W8A8 int8: the quantized input's product per CPU kernel", body)


if __name__ == "__main__":
    main()
