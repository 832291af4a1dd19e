"""The llama.cpp-arithmetic products (cpu_native ki_q8_0_linear) at the large benchmark model's shapes, against
their rooflines, before / after in one process.

Shapes of bench_quantized_decode's large model (hidden 1024, intermediate 4096): qkv [2048, 1024], o [1024,
1024], gate_up [8192, 1024], down [1024, 4096]; int4 in groups of 128 (w4a16) and int8 per channel (w8a16), as
its checkpoints. Each shape is held in as many copies as make 48 MB a library compared (96 MB at least) and the
calls cycle through them, each library 48 MB behind the one before, so the weights come from memory as in a
decode step (the model's ~100 MB of int4 layer weights exceed the 32 MB L3).
For each (kind, shape, tokens): the fastest call of --calls, in us, and what it reached: GB/s of weights +
scales + offsets read, GMAC/s. `--rev REV` compiles kernels.c of git revision REV too (bench_cpu_native_ab.py)
and interleaves the two libraries call by call. `--pool`: the pool's fixed cost per call (a 16-row product).
`--step`: a decode step's 48 products (12 layers), each library a step in turn.
`python benchmarks/bench_q8_0_shapes.py [--rev main] [--threads 2] [--tokens 1,4,16] [--step]`"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_cpu_native_ab import compile_library, load_library  # noqa: E402

from kubeinfer.engine.platforms.cpu.native import ops  # noqa: E402

SHAPES = {"qkv": (2048, 1024), "o": (1024, 1024), "gate_up": (8192, 1024), "down": (1024, 4096)}
WORKING_SET = 96e6  # bytes the calls cycle through: three times the L3


def weights(kind: str, n: int, k: int, gen: torch.Generator) -> tuple:
    """ki_q8_0_linear's weight arguments (packed, bits, scale, offset, groups, group size) and their bytes."""
    bits, group = (4, 128) if kind == "int4" else (8, k)
    lo, hi = (-8, 8) if bits == 4 else (-128, 128)
    values = torch.randint(lo, hi, (n, k), generator=gen, dtype=torch.int8)
    packed = ops.pack_int4(values) if bits == 4 else ops.pack_int8(values)
    scale = ops.pack_groups(torch.rand(n, k // group, generator=gen) * 0.01, torch.float32)
    offset = ops.pack_groups(torch.full((n, k // group), 128 if bits == 8 else 8, dtype=torch.int32), torch.int32)
    size = sum(t.numel() * t.element_size() for t in (packed, scale, offset))
    return (packed, bits, scale, offset, k // group, group), size


def call(lib, x, w, n, out) -> None:
    packed, bits, scale, offset, groups, group = w
    lib.ki_q8_0_linear(x.data_ptr(), x.nbytes, x.shape[0], x.shape[1], packed.data_ptr(), packed.nbytes, bits,
                       scale.data_ptr(), scale.nbytes, offset.data_ptr(), offset.nbytes, groups, group, n,
                       out.data_ptr(), out.nbytes)


def compile_variant(defines: str, where: Path):
    """The working tree's kernels.c compiled with extra -D flags (comma-separated NAME=VALUE): variants of one
    kernel A/B'd in one process while tuning."""
    from kubeinfer.engine.platforms.cpu.native import build

    out = where / "lib.so"
    extra = [f"-D{d}" for d in defines.split(",") if d]
    subprocess.run([build.compiler(), *build.flags(False), *extra, "-o", str(out),
                    str(Path(build.__file__).parent / "kernels.c"), "-lm"], check=True)
    return load_library(out)


def shapes(libs: dict, kinds: list[str], tokens: list[int], calls: int, hot: bool, threads: int) -> None:
    gen = torch.Generator().manual_seed(0)
    print("| kind | shape [N, K] | tokens | " + " | ".join(f"{t} us (GB/s, GMAC/s)" for t in libs)
          + " | speed-up over the first |")
    for kind in kinds:
        for name, (n, k) in SHAPES.items():
            first = weights(kind, n, k, gen)
            size = first[1]
            copies = 0 if hot else int(WORKING_SET * max(2, len(libs)) / 2 // size)  # 48 MB apart a library
            layers = [first] + [weights(kind, n, k, gen) for _ in range(copies)]
            for m in tokens:
                x, out = torch.randn(m, k, generator=gen), torch.empty(m, n)
                best = {tag: 1.0 for tag in libs}
                for _ in range(calls):
                    # one thread: the libraries call by call; more: a pass over the copies per library (one
                    # library's pool spinning at a time)
                    tags, count = list(libs), len(layers)  # call i: library t reads copy i + t * count / libs
                    order = [[(t, layers[(i + j * count // len(tags)) % count][0]) for j, t in enumerate(tags)]
                             for i in range(count)] if threads == 1 else [[(t, w) for w, _ in layers] for t in libs]
                    for tag, w in (pair for group in order * (20 if hot else 1) for pair in group):
                        start = time.perf_counter()
                        call(libs[tag], x, w, n, out)
                        best[tag] = min(best[tag], time.perf_counter() - start)
                cells = [f"{best[t] * 1e6:.1f} ({size / best[t] / 1e9:.0f}, {m * n * k / best[t] / 1e9:.0f})"
                         for t in libs]
                first_tag = next(iter(libs))
                ratio = " | " + " ".join(f"{best[first_tag] / best[t]:.2f}x" for t in list(libs)[1:]) + " |"
                print(f"| {kind} | {name} [{n}, {k}] | {m} | " + " | ".join(cells) + ratio, flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")


def steps(libs: dict, kinds: list[str], tokens: list[int], calls: int) -> None:
    """A decode step's products: the four shapes of 12 layers in turn (the model's weights, more than the L3),
    each library a whole step in turn; the fastest and the median step of `calls`, in ms."""
    gen = torch.Generator().manual_seed(2)
    for kind in kinds:
        layers = [[(weights(kind, n, k, gen)[0], n, k) for n, k in SHAPES.values()] for _ in range(12)]
        for m in tokens:
            xs = {k: torch.randn(m, k, generator=gen) for k in (1024, 4096)}
            outs = {n: torch.empty(m, n) for n, _ in SHAPES.values()}
            times = {t: [] for t in libs}
            for _ in range(calls):
                for tag, lib in libs.items():
                    start = time.perf_counter()
                    for layer in layers:
                        for w, n, k in layer:
                            call(lib, xs[k], w, n, outs[n])
                    times[tag].append(time.perf_counter() - start)
            cells = []
            for tag in libs:
                ts = sorted(times[tag])
                cells.append(f"{tag} {ts[0] * 1e3:.2f} / {ts[len(ts) // 2] * 1e3:.2f} ms")
            print(f"step products, {kind}, {m} tokens (fastest / median): " + ", ".join(cells)
                  + f", load {os.getloadavg()[0]:.1f}", flush=True)


def pool(libs: dict, threads: int, calls: int) -> None:
    """A 16-row x 32-input product: one work item, so the pool is not used, against 2 row groups' worth on
    `threads` (the pool woken), median of `calls`."""
    gen = torch.Generator().manual_seed(1)
    for n in (16, 64):
        w, _ = weights("int8", n, 32, gen)
        x, out = torch.randn(1, 32, generator=gen), torch.empty(1, n)
        for tag, lib in libs.items():
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                call(lib, x, w, n, out)
                times.append(time.perf_counter() - start)
            times.sort()
            print(f"pool: {tag} N={n} ({(n + 31) // 32} items, {threads} threads) median "
                  f"{times[len(times) // 2] * 1e6:.2f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rev", help="a git revision to compare the working tree's kernels with")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", default="1,4,16")
    parser.add_argument("--kinds", default="int4,int8")
    parser.add_argument("--calls", type=int, default=5, help="passes over the copies of each shape")
    parser.add_argument("--pool", action="store_true", help="the pool's fixed cost per call instead")
    parser.add_argument("--hot", action="store_true", help="one copy of each shape: weights in cache")
    parser.add_argument("--step", action="store_true", help="a decode step's 48 products instead")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="-D sets (NAME=VALUE,...) of the working tree's kernels.c, each compiled and compared")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {}
        if args.rev:
            (Path(tmp) / "old").mkdir()
            libs["old"] = compile_library(args.rev, Path(tmp) / "old")
        (Path(tmp) / "new").mkdir()
        libs["new"] = compile_library(None, Path(tmp) / "new")
        for i, defines in enumerate(args.variants):
            (Path(tmp) / f"v{i}").mkdir()
            libs[f"{i}:{defines}"] = compile_variant(defines, Path(tmp) / f"v{i}")
        for lib in libs.values():
            lib.ki_init(args.threads, 50)
        print(f"threads {args.threads}, load {os.getloadavg()[0]:.1f}")
        if args.pool:
            pool(libs, args.threads, 3000)
        else:
            kinds, tokens = args.kinds.split(","), [int(t) for t in args.tokens.split(",")]
            if args.step:
                steps(libs, kinds, tokens, args.calls)
            else:
                shapes(libs, kinds, tokens, args.calls, args.hot, args.threads)


if __name__ == "__main__":
    main()
