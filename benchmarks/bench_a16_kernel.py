"""The exact A16 product alone (cpu_native/a16_linear.c, ki_a16_linear) on the 222M benchmark model's shapes
(bench_quantized_decode's `large`: qkv [2048, 1024], o [1024, 1024], gate_up [8192, 1024], down [1024, 4096] int4
in groups of 128, lm_head [16384, 1024] int8 per channel), at 1 and 16 tokens, on 1 or 2 threads, with the weights
warm (one copy, reused: they stay in the caches) or cold (24 copies in turn, as a decode step streams its 12
layers' weights from memory). `--base-lib PATH`: another build of the library (e.g. the cached one of an earlier
revision) timed in the same rounds, interleaved, and its outputs checked bit-equal to this one's.

    python benchmarks/bench_a16_kernel.py [--threads 1,2] [--base-lib PATH] [--no-write]
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

from kubeinfer.engine.model_executor.layers.quantization.cpu_native import a16_method, build, ops  # noqa: E402

SHAPES = (("qkv", 1024, 2048, 4, 128), ("o", 1024, 1024, 4, 128), ("gate_up", 1024, 8192, 4, 128),
          ("down", 4096, 1024, 4, 128), ("lm_head", 1024, 16384, 8, None))
COLD_COPIES = 24


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.ki_init.argtypes, lib.ki_init.restype = [ctypes.c_int, ctypes.c_long], ctypes.c_int
    lib.ki_a16_linear.argtypes, lib.ki_a16_linear.restype = a16_method.SIGNATURE
    return lib


def operands(k: int, n: int, bits: int, group: int | None, copies: int, gen: torch.Generator):
    size = group or k
    lo, hi = (-8, 8) if bits == 4 else (-128, 128)
    w = torch.randint(lo, hi, (n, k), dtype=torch.int8, generator=gen)
    packed = a16_method.pack(w, bits)
    zero = a16_method.pack_zero(torch.zeros(n, k // size, dtype=torch.int8), bits)
    scale = ops.pack_groups(torch.rand(n, k // size, generator=gen) + 0.01, torch.float32)
    return [packed] + [packed.clone() for _ in range(copies - 1)], scale, zero, k // size, size


def time_ms(lib, x, weights, bits, scale, zero, groups, size, n, out, reps: int) -> float:
    m, k = x.shape
    start = time.perf_counter()
    for i in range(reps):
        lib.ki_a16_linear(x.data_ptr(), m, k, weights[i % len(weights)].data_ptr(), bits, scale.data_ptr(),
                          zero.data_ptr(), groups, size, n, out.data_ptr())
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--base-lib", help="another build of the library, timed in the same rounds")
    parser.add_argument("--rounds", type=int, default=5)
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
        for name, k, n, bits, group in SHAPES:
            for state, copies in (("warm", 1), ("cold", COLD_COPIES)):
                weights, scale, zero, groups, size = operands(k, n, bits, group, copies, gen)
                for m in (1, 16):
                    x = torch.randn(m, k, generator=gen)
                    outs = {key: torch.empty(m, n) for key in libs}
                    reps = max(COLD_COPIES, int(2e8 / (n * k * m)) // COLD_COPIES * COLD_COPIES)
                    best = {key: min(time_ms(lib, x, weights, bits, scale, zero, groups, size, n, outs[key], reps)
                                     for _ in range(args.rounds)) for key, lib in libs.items()}
                    if len(outs) > 1 and not torch.equal(outs["this"], outs["base"]):
                        raise SystemExit(f"{name} m={m}: the two libraries' outputs differ")
                    rows.append((threads, name, f"[{n}, {k}] int{bits}", state, m, best))
                    print(threads, name, state, m, {key: f"{v:.3f}" for key, v in best.items()}, flush=True)
        loads.append(os.getloadavg()[0])
    head = "| threads | product | weights | " + " | ".join(
        f"{m} token{'s' * (m > 1)} ms" + (" (base ms, speed-up base/this)" if args.base_lib else "")
        for m in (1, 16)) + " |"
    table = [head, "|" + "---|" * (3 + 2)]
    for threads, name, shape, state, *_ in rows[::2]:
        cells = []
        for row in rows:
            if row[:4] == (threads, name, shape, state):
                t = row[5]
                cells.append(f"{t['this']:.3f}" + (f" ({t['base']:.3f}, {t['base'] / t['this']:.2f}x)"
                                                   if "base" in t else ""))
        table.append(f"| {threads} | {name} {shape} | {state} | " + " | ".join(cells) + " |")
    body = (f"Command: `python benchmarks/bench_a16_kernel.py --threads {args.threads}"
            f"{' --base-lib BASE' if args.base_lib else ''}{f' --rounds {args.rounds}' if args.rounds != 5 else ''}`. "
            f"Machine: {platform.machine()}, {os.cpu_count()} cores "
            f"shared with other jobs (load {min(loads):.1f}-{max(loads):.1f} while measured), torch "
            f"{torch.__version__}. ki_a16_linear alone, best of {args.rounds} rounds; weights warm (one copy, in the "
            f"caches) or cold ({COLD_COPIES} copies in turn: a decode step's case, whose weights come from memory)."
            f"\n\n" + "\n".join(table) + "\n")
    print(body)
    if not args.no_write:
        update_results("cpu-a16-kernel", "The exact A16 product alone on the 222M model's shapes (CPU)", body)


if __name__ == "__main__":
    main()
