"""The harness of the native kernels' benchmarks (bench_a16_kernel.py, bench_w4a8_kernel.py): one product timed
alone at 1 and 16 tokens, on the given thread counts, its weights warm (one copy, reused: they stay in the caches)
or cold (COLD_COPIES copies in turn, as a decode step streams its layers' weights from memory). `--base-lib PATH`:
another build of the library (e.g. the cached one of an earlier revision) timed in the same rounds, interleaved
round by round, and its outputs checked bit-equal to this one's."""
from __future__ import annotations

import argparse
import ctypes
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kubeinfer.engine.platforms.cpu.native import build

COLD_COPIES = 24
TOKENS = (1, 16)
# product(lib, x [m, k] float32, i: which copy of the weights, out [m, n] float32): one call of the kernel
Product = Callable[[ctypes.CDLL, torch.Tensor, int, torch.Tensor], None]


@dataclass(frozen=True)
class Case:
    name: str
    shape: str  # as the table shows it
    k: int
    n: int
    operands: Callable[[int, torch.Generator], Product]  # (copies of the weights, generator) -> the product


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--base-lib", help="another build of the library, timed in the same rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only")


def copies(t: torch.Tensor, count: int) -> list[torch.Tensor]:
    """t and count - 1 copies of it (the cold weights: each read from memory in its turn)."""
    return [t] + [t.clone() for _ in range(count - 1)]


def libraries(base_lib: str | None, signatures: dict[str, tuple]) -> dict[str, ctypes.CDLL]:
    """This tree's library (built) and, given, the base build, each with ki_init and `signatures` set."""
    paths = {"this": str(build.build(False)), **({"base": base_lib} if base_lib else {})}
    libs = {}
    for key, path in paths.items():
        lib = libs[key] = ctypes.CDLL(path)
        lib.ki_init.argtypes, lib.ki_init.restype = [ctypes.c_int, ctypes.c_long], ctypes.c_int
        for name, (argtypes, restype) in signatures.items():
            getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, restype
    return libs


def _time_ms(product: Product, lib, x: torch.Tensor, out: torch.Tensor, reps: int, count: int) -> float:
    start = time.perf_counter()
    for i in range(reps):
        product(lib, x, i % count, out)
    return (time.perf_counter() - start) / reps * 1e3


def compare(libs: dict, threads: str, cases: list[Case], rounds: int) -> tuple[list, list[float]]:
    """Best ms of each library per (threads, case, warm/cold, tokens), the libraries interleaved round by round;
    returns the rows and the load averages seen."""
    torch.set_num_threads(1)  # as in a decode step: torch's OpenMP workers, spinning after its ops, take a core
    gen = torch.Generator().manual_seed(0)
    rows, loads = [], [os.getloadavg()[0]]
    for count in [int(t) for t in threads.split(",")]:
        for lib in libs.values():
            lib.ki_init(count, -1)
        for case in cases:
            for state, weights in (("warm", 1), ("cold", COLD_COPIES)):
                product = case.operands(weights, gen)
                for m in TOKENS:
                    x = torch.randn(m, case.k, generator=gen)
                    outs = {key: torch.empty(m, case.n) for key in libs}
                    reps = max(COLD_COPIES, int(2e8 / (case.n * case.k * m)) // COLD_COPIES * COLD_COPIES)
                    best = {key: float("inf") for key in libs}
                    for _ in range(rounds):
                        for key, lib in libs.items():
                            best[key] = min(best[key], _time_ms(product, lib, x, outs[key], reps, weights))
                    if len(outs) > 1 and not torch.equal(outs["this"], outs["base"]):
                        raise SystemExit(f"{case.name} m={m}: the two libraries' outputs differ")
                    rows.append((count, case.name, case.shape, state, m, best))
                    print(count, case.name, state, m, {key: f"{v:.3f}" for key, v in best.items()}, flush=True)
        loads.append(os.getloadavg()[0])
    return rows, loads


def table(rows: list, base: bool) -> str:
    head = "| threads | product | weights | " + " | ".join(
        f"{m} token{'s' * (m > 1)} ms" + (" (base ms, speed-up base/this)" if base else "") for m in TOKENS) + " |"
    lines = [head, "|" + "---|" * (3 + len(TOKENS))]
    for threads, name, shape, state, *_ in rows[::len(TOKENS)]:
        cells = [f"{t['this']:.3f}" + (f" ({t['base']:.3f}, {t['base'] / t['this']:.2f}x)" if "base" in t else "")
                 for *key, _, t in rows if tuple(key) == (threads, name, shape, state)]
        lines.append(f"| {threads} | {name} {shape} | {state} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def command_and_machine(script: str, args: argparse.Namespace, extra: str, loads: list[float]) -> str:
    """The sentence naming the command (its options as given) and the machine."""
    options = (f" --threads {args.threads}{' --base-lib BASE' if args.base_lib else ''}"
               f"{f' --rounds {args.rounds}' if args.rounds != 5 else ''}{extra}")
    return (f"Command: `python benchmarks/{script}{options}`. Machine: {platform.machine()}, {os.cpu_count()} cores "
            f"shared with other jobs (load {min(loads):.1f}-{max(loads):.1f} while measured), torch "
            f"{torch.__version__}.")


def weights_sentence(rounds: int) -> str:
    return (f"best of {rounds} rounds; weights warm (one copy, in the caches) or cold ({COLD_COPIES} copies in "
            "turn: a decode step's case, whose weights come from memory).")
