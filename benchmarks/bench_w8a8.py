"""W8A8 int8 on the CPU: one layer's product with its input quantized per token (activations.py), by fake
quantization (quantize-dequantize the input, then F.linear with the dequantized weight: the reference's own
computation) against torch._int_mm (int8 x int8 -> int32, then both scales: activations.int8_linear), with
the unquantized F.linear beside them. Calls interleaved round by round, so the load on the shared machine
falls on all alike; the ratios are what the module docstring of activations.py cites.

    python benchmarks/bench_w8a8.py [--rounds 15]
    python benchmarks/bench_w8a8.py --engine [--tokens 32]   # whole-engine decode: float32, W8A8 per kernel
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


def engine_rates(tokens: int, repeats: int) -> None:
    """Decode tok/s at batch 1 and 16 of the throughput benchmark's model: float32 checkpoint, and its W8A8 int8
    checkpoint (written by the compressed-tensors package) through torch._int_mm and through fake quantization;
    systems interleaved round by round."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from bench_quantized_decode import decode_rate
    from bench_throughput import MODEL_SHAPE
    from quant_checkpoints import ct_compress, ct_scheme, float_weights, write_checkpoint

    from kubeinfer.dev.testing.random_model import build_random_model

    root = Path(".cache")
    model_dir = root / "bench-llama-33m"
    if not (model_dir / "config.json").exists():
        build_random_model(model_dir, "llama", tokenizer=False, initializer_range=0.02, **MODEL_SHAPE)
    w8a8 = root / "bench-llama-33m-w8a8"
    if not (w8a8 / "config.json").exists():
        config = ct_scheme("int-quantized", 8, "int", "channel", True, None, activations=True)
        write_checkpoint(model_dir, w8a8, ct_compress(float_weights(model_dir), config), config)
    systems = {"float32 checkpoint": (str(model_dir), None),
               "float32 checkpoint, OpenBLAS small steps off": (str(model_dir), "off"),
               "W8A8 int8, torch._int_mm": (str(w8a8), "int_mm"),
               "W8A8 int8, fake quantization": (str(w8a8), "fake_quant")}
    rates = {name: {1: [], 16: []} for name in systems}
    for _ in range(repeats):
        for name, (path, kernel) in systems.items():
            os.environ["KUBEINFER_W8A8_KERNEL"] = kernel if kernel in ("int_mm", "fake_quant") else "int_mm"
            os.environ["KUBEINFER_CPU_OPENBLAS"] = "0" if kernel == "off" else "1"
            for batch in (1, 16):
                rates[name][batch].append(decode_rate(path, "float32", None, batch, tokens, 1))
    os.environ.pop("KUBEINFER_W8A8_KERNEL", None)
    os.environ.pop("KUBEINFER_CPU_OPENBLAS", None)
    base = {b: statistics.median(rates["float32 checkpoint"][b]) for b in (1, 16)}
    lines = ["| system | batch 1 tok/s | vs float32 | batch 16 tok/s | vs float32 |", "|---|---|---|---|---|"]
    for name, r in rates.items():
        one, sixteen = statistics.median(r[1]), statistics.median(r[16])
        print(f"{name:40s} {one:7.1f} {sixteen:8.1f}")
        lines.append(f"| {name} | {one:.1f} | {one / base[1]:.2f}x | {sixteen:.1f} | {sixteen / base[16]:.2f}x |")
    body = "\n".join([f"Command: `python benchmarks/bench_w8a8.py --engine --tokens {tokens} --repeats {repeats}`. "
                      f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs (load average "
                      f"{os.getloadavg()[0]:.1f} at the end). The throughput benchmark's random Llama (float32), "
                      f"32-token prompts, {tokens} tokens greedy; median of {repeats} interleaved rounds. W8A8 "
                      "layers run "
                      "torch's products (one thread in a small step, platforms/cpu/cpu_blas.py); the float32 model's "
                      "small "
                      "steps go through OpenBLAS unless turned off. The machine was oversubscribed (other jobs on its "
                      "2 cores): part of W8A8's lead may be the single-threaded small steps escaping thread "
                      "contention, not the int8 bytes alone; rerun on a quiet machine before quoting the ratio.",
                      "", *lines])
    update_results("w8a8-engine", "W8A8 int8: engine decode on the CPU", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--engine", action="store_true", help="time the whole engine's decode instead")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.engine:
        engine_rates(args.tokens, args.repeats)
        return
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
