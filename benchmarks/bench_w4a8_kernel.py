"""The native W4A8 product alone (cpu_native/w4a8_linear.c, ki_w4a8_f32: per-token int8 quantization, then the int4
x int8 product) on the 222M benchmark model's shapes (bench_quantized_decode's `large`: qkv [2048, 1024], o [1024,
1024], gate_up [8192, 1024], down [1024, 4096], int4 symmetric in groups of 128, as bench_w4a8_decode's checkpoint),
at 1 and 16 tokens, on 1 or 2 threads, weights warm (one copy, reused: in the caches) or cold (24 copies in turn,
as a decode step streams its 12 layers' weights from memory). `--base-lib PATH`: another build of the library
timed in the same rounds, interleaved, its outputs checked bit-equal to this one's. `--w8a8`: the W8A8 int8 product
(kernels.c's ki_w8a8: int8 weights per channel, int8 activations) on the same shapes instead (its own section).

    python benchmarks/bench_w4a8_kernel.py [--threads 1,2] [--base-lib PATH] [--w8a8] [--no-write]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from results import update_results  # noqa: E402

from kubeinfer.engine.model_executor.layers.quantization.cpu_native import build, ops, w4a8_ops  # noqa: E402

SHAPES = (("qkv", 1024, 2048), ("o", 1024, 1024), ("gate_up", 1024, 8192), ("down", 4096, 1024))
GROUP = 128
COLD_COPIES = 24


def load(path: str) -> ctypes.CDLL:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib = ctypes.CDLL(path)
    lib.ki_init.argtypes, lib.ki_init.restype = [i, ctypes.c_long], i
    lib.ki_w4a8_f32.argtypes, lib.ki_w4a8_f32.restype = [p, i, i, p, p, i, i, i, p], i
    lib.ki_w8a8.argtypes, lib.ki_w8a8.restype = [p, p, i, i, p, p, i, p], i
    return lib


def operands(k: int, n: int, copies: int, gen: torch.Generator, w8a8: bool):
    if w8a8:
        packed, scale = ops.pack_int8(torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)), \
            torch.rand(n, generator=gen) + 0.01
    else:
        w = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
        packed, scale = w4a8_ops.pack(w, torch.rand(n, k // GROUP, generator=gen) + 0.01)
    return [packed] + [packed.clone() for _ in range(copies - 1)], scale


def time_ms(lib, x, weights, scale, n, out, reps: int, w8a8: bool) -> float:
    m, k = x.shape
    if w8a8:  # the activations quantized once, outside the timing
        gen = torch.Generator().manual_seed(m * k)  # the same activations for every library
        q, sx = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen), torch.rand(m, generator=gen)
    start = time.perf_counter()
    for i in range(reps):
        w = weights[i % len(weights)].data_ptr()
        status = lib.ki_w8a8(q.data_ptr(), sx.data_ptr(), m, k, w, scale.data_ptr(), n, out.data_ptr()) if w8a8 \
            else lib.ki_w4a8_f32(x.data_ptr(), m, k, w, scale.data_ptr(), scale.shape[1], GROUP, n, out.data_ptr())
        assert status == 0, status
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--base-lib", help="another build of the library, timed in the same rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--w8a8", action="store_true", help="time ki_w8a8 (int8 weights) instead")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    libs = {"this": load(str(build.build(False)))}
    if args.base_lib:
        libs["base"] = load(args.base_lib)
    torch.set_num_threads(1)  # as in a decode step: torch's OpenMP workers, spinning after its ops, take a core
    gen = torch.Generator().manual_seed(0)
    rows, loads = [], [os.getloadavg()[0]]
    for threads in [int(t) for t in args.threads.split(",")]:
        for lib in libs.values():
            lib.ki_init(threads, -1)
        for name, k, n in SHAPES:
            for state, copies in (("warm", 1), ("cold", COLD_COPIES)):
                weights, scale = operands(k, n, copies, gen, args.w8a8)
                for m in (1, 16):
                    x = torch.randn(m, k, generator=gen)
                    outs = {key: torch.empty(m, n) for key in libs}
                    reps = max(COLD_COPIES, int(2e8 / (n * k * m)) // COLD_COPIES * COLD_COPIES)
                    best = {key: float("inf") for key in libs}
                    for _ in range(args.rounds):  # the libraries interleaved round by round
                        for key, lib in libs.items():
                            best[key] = min(best[key], time_ms(lib, x, weights, scale, n, outs[key], reps, args.w8a8))
                    if len(outs) > 1 and not torch.equal(outs["this"], outs["base"]):
                        raise SystemExit(f"{name} m={m}: the two libraries' outputs differ")
                    rows.append((threads, name, f"[{n}, {k}]", state, m, best))
                    print(threads, name, state, m, {key: f"{v:.3f}" for key, v in best.items()}, flush=True)
        loads.append(os.getloadavg()[0])
    head = "| threads | product | weights | " + " | ".join(
        f"{m} token{'s' * (m > 1)} ms" + (" (base, base/this)" if args.base_lib else "") for m in (1, 16)) + " |"
    table = [head, "|" + "---|" * (3 + 2)]
    for threads, name, shape, state, *_ in rows[::2]:
        cells = []
        for row in rows:
            if row[:4] == (threads, name, shape, state):
                t = row[5]
                cells.append(f"{t['this']:.3f}" + (f" ({t['base']:.3f}, {t['base'] / t['this']:.2f}x)"
                                                   if "base" in t else ""))
        table.append(f"| {threads} | {name} {shape} | {state} | " + " | ".join(cells) + " |")
    what = ("ki_w8a8 alone (int8 weights per channel, the activations quantized before)" if args.w8a8 else
            f"ki_w4a8_f32 alone (int4 in groups of {GROUP}, activations quantized per token inside)")
    body = (f"Command: `python benchmarks/bench_w4a8_kernel.py --threads {args.threads}"
            f"{' --base-lib BASE' if args.base_lib else ''}{' --w8a8' if args.w8a8 else ''}`. Machine: "
            f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs (load {min(loads):.1f}-"
            f"{max(loads):.1f} while measured), torch {torch.__version__}. {what}, best of {args.rounds} rounds;"
            f" weights warm (one copy, in the caches) or cold ({COLD_COPIES} "
            f"copies in turn: a decode step's case, whose weights come from memory).\n\n" + "\n".join(table) + "\n")
    print(body)
    if not args.no_write:
        if args.w8a8:
            update_results("cpu-w8a8-kernel", "The native W8A8 int8 product alone on the 222M model's shapes (CPU)",
                           body)
        else:
            update_results("cpu-w4a8-kernel", "The native W4A8 product alone on the 222M model's shapes (CPU)", body)


if __name__ == "__main__":
    main()
