"""Before / after for the native CPU kernels (platforms/cpu/native), in one process so the load is
the same for both: kernels.c (with kernels_q8_0.c) of git revision REV is built next to the working tree's, and
  * default: the one-layer products ([tokens, 2048] x [8192, 2048], 1 and 16 tokens, 1 and 2 threads) through
    each library, interleaved call by call, fastest of --calls;
  * --engine: the bench_quantized_decode engines (large model, cpu_int8_vnni and cpu_int4_vnni, its checkpoints
    under .cache: run that benchmark once first), the library swapped between rounds, best of --rounds.
Only the C changes are compared (ops.py is the working tree's for both).
`python benchmarks/bench_cpu_native_ab.py --rev main [--engine]`"""
from __future__ import annotations

import argparse
import ctypes
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kubeinfer.engine.platforms.cpu.native import build, ops

HERE = Path(build.__file__).parent


def compile_library(rev: str | None, where: Path) -> ctypes.CDLL:
    """kernels.c of `rev` (None: the working tree) compiled with build.py's flags."""
    src = HERE / "kernels.c"
    if rev:
        for name in build.SOURCES:
            text = subprocess.run(["git", "-C", str(HERE), "show", f"{rev}:./{name}"], capture_output=True,
                                  text=True, check=True).stdout
            (where / name).write_text(text)
        src = where / "kernels.c"
    out = where / "lib.so"
    subprocess.run([build.compiler(), *build.flags(False), "-o", str(out), str(src), "-lm"], check=True)
    return load_library(out)


def load_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.ki_init.argtypes, lib.ki_init.restype = [ctypes.c_int, ctypes.c_long], ctypes.c_int
    lib.ki_q8_0_linear.argtypes, lib.ki_q8_0_linear.restype = ops.PACKED_SIGNATURE  # libraries since the sizes
    return lib


def products(libs: dict, calls: int) -> None:
    out_f, cols, group = 8192, 2048, 128
    gen = torch.Generator().manual_seed(0)
    p8 = ops.pack_int8(torch.randint(-128, 128, (out_f, cols), generator=gen, dtype=torch.int8))
    p4 = ops.pack_int4(torch.randint(-8, 8, (out_f, cols), generator=gen, dtype=torch.int8))
    s8, s4 = ops.pack_groups(torch.rand(out_f, 1), torch.float32), ops.pack_groups(torch.rand(out_f, cols // group),
                                                                                      torch.float32)
    o8 = ops.pack_groups(torch.full((out_f, 1), 128, dtype=torch.int32), torch.int32)
    o4 = ops.pack_groups(torch.full((out_f, cols // group), 8, dtype=torch.int32), torch.int32)
    weights = {"int8": (p8, 8, s8, o8, 1, cols), "int4": (p4, 4, s4, o4, cols // group, group)}
    for threads in (1, 2):
        for lib in libs.values():
            lib.ki_init(threads, 0)
        for tokens in (1, 16):
            x, out = torch.randn(tokens, cols, generator=gen), torch.empty(tokens, out_f)
            best = {}
            for _ in range(calls):
                for kind, (w, bits, s, o, groups, size) in weights.items():
                    for tag, lib in libs.items():
                        start = time.perf_counter()
                        lib.ki_q8_0_linear(x.data_ptr(), x.nbytes, tokens, cols, w.data_ptr(), w.nbytes, bits,
                                           s.data_ptr(), s.nbytes, o.data_ptr(), o.nbytes, groups, size, out_f,
                                           out.data_ptr(), out.nbytes)
                        key = (kind, tag)
                        best[key] = min(best.get(key, 1.0), time.perf_counter() - start)
            print(f"{threads} threads, {tokens:2d} tokens: " + "  ".join(
                f"{k} old {best[(k, 'old')] * 1e3:.3f} new {best[(k, 'new')] * 1e3:.3f} ms "
                f"({best[(k, 'old')] / best[(k, 'new')]:.2f}x)" for k in weights), f"load {os.getloadavg()[0]:.1f}")


def engines(libs: dict, rounds: int) -> None:
    sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]
    from bench_quantized_decode import EngineSystem

    ops.library()
    for lib in libs.values():
        lib.ki_init(ops.default_threads(), 50)
    systems = {k: EngineSystem(Path(f".cache/bench-llama-222m-{c}"), 32, f"cpu_{k}_vnni")
               for k, c in (("int8", "w8a16"), ("int4", "w4a16"))}
    best = {}
    for _ in range(rounds):
        for batch in (1, 16):
            prompts = [[random.Random(b).randrange(100, 16000) for _ in range(32)] for b in range(batch)]
            for name, system in systems.items():
                for tag, lib in libs.items():
                    ops._state["lib"] = lib
                    ops._state.pop("q8_0", None)  # ops.q8_0_linear's cached ki_q8_0_linear: the swapped library's
                    key = (name, batch, tag)
                    best[key] = max(best.get(key, 0.0), system.rate(prompts))
        print(f"load {os.getloadavg()[0]:.1f}", flush=True)
    for name in systems:
        for batch in (1, 16):
            old, new = best[(name, batch, "old")], best[(name, batch, "new")]
            print(f"cpu_{name}_vnni batch {batch}: old {old:.1f} tok/s, new {new:.1f} tok/s ({new / old:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rev", required=True, help="the git revision to compare the working tree with")
    parser.add_argument("--engine", action="store_true", help="whole engines instead of one product")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        (Path(tmp) / "old").mkdir(), (Path(tmp) / "new").mkdir()
        libs = {"old": compile_library(args.rev, Path(tmp) / "old"), "new": compile_library(None, Path(tmp) / "new")}
        engines(libs, args.rounds) if args.engine else products(libs, args.calls)


if __name__ == "__main__":
    main()
