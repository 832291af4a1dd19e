"""The native decode attention (platforms/cpu/native/attention.c) alone, by KV cache type: one layer's call at batch 16
(16 query heads over 8 KV heads, head_dim 64: the `large` model of bench_quantized_decode.py) over contexts of
--ctx positions, with a float32, bfloat16, fp8 e4m3 and fp8 e5m2 cache; `--base-lib PATH`: another build of the
library (e.g. the cached one of an earlier revision) timed in the same rounds, interleaved, its outputs checked
bit-equal to this one's. Best of --rounds rounds of 10 calls each.

    python benchmarks/bench_decode_attention.py [--ctx 64,512] [--threads 1] [--base-lib BASE [--base-fp8-kind-2]]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parents[1] / "tests"), str(Path(__file__).parents[1] / "tests" / "engine")]
import kernel_ab  # noqa: E402
from results import update_results  # noqa: E402
from test_cpu_native_attention import make_step  # noqa: E402

P, INT, N = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
SIGNATURE = ([P, N, INT, P, P, N, P, P, P, INT, P, P, N, P, INT, INT, INT, INT, INT, INT, ctypes.c_float, P], INT)
CACHES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8 e4m3": torch.float8_e4m3fn,
          "fp8 e5m2": torch.float8_e5m2}


def call(lib, q, k_cache, v_cache, meta, out) -> None:
    dtype = k_cache.dtype
    kind = 0 if dtype == torch.float32 else 1 if dtype == torch.bfloat16 else 2 if lib.kinds == 2 or \
        dtype == torch.float8_e4m3fn else 3  # (an older library's kind 2 is any fp8)
    lut = torch.arange(256, dtype=torch.uint8).view(dtype).float() if kind >= 2 else None
    tables = meta.block_tables
    status = lib.ki_decode_attention(q.data_ptr(), q.stride(0), 0, None, None, 0, None, k_cache.data_ptr(),
                                     v_cache.data_ptr(), kind, None if lut is None else lut.data_ptr(),
                                     tables.data_ptr(), tables.stride(0), meta.context_lens_tensor.data_ptr(),
                                     q.shape[0], 16, 8, 64, 16, 0, 0.125, out.data_ptr())
    assert status == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ctx", default="64,512")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--base-lib")
    parser.add_argument("--base-fp8-kind-2", action="store_true",
                        help="the base build takes kind 2 for both fp8 types (before e5m2 had kind 3)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    libs = kernel_ab.libraries(args.base_lib, {"ki_decode_attention": SIGNATURE})
    for key, lib in libs.items():
        lib.ki_init(args.threads, -1)
        lib.kinds = 2 if key == "base" and args.base_fp8_kind_2 else 3
    loads, rows = [os.getloadavg()[0]], []
    for ctx in [int(c) for c in args.ctx.split(",")]:
        for name, dtype in CACHES.items():
            q, k_cache, v_cache, meta = make_step([ctx] * 16, 16, 8, 64, torch.float32, dtype, seed=1)
            outs = {key: torch.empty_like(q) for key in libs}
            best = {key: float("inf") for key in libs}
            for _ in range(args.rounds):
                for key, lib in libs.items():
                    call(lib, q, k_cache, v_cache, meta, outs[key])
                    start = time.perf_counter()
                    for _ in range(10):
                        call(lib, q, k_cache, v_cache, meta, outs[key])
                    best[key] = min(best[key], (time.perf_counter() - start) / 10 * 1e3)
            if "base" in outs and not torch.equal(outs["base"], outs["this"]):
                raise SystemExit(f"{name} ctx {ctx}: the two libraries' outputs differ")
            rows.append((ctx, name, best))
            print(ctx, name, {key: f"{v:.3f}" for key, v in best.items()}, flush=True)
        loads.append(os.getloadavg()[0])
    f32 = {ctx: t["this"] for ctx, name, t in rows if name == "float32"}
    lines = ["| context | cache | ms per call | / float32 cache" + (" | base ms | base / this" if args.base_lib else "")
             + " |", "|---|---|---|---" + ("|---|---" if args.base_lib else "") + "|"]
    for ctx, name, t in rows:
        lines.append(f"| {ctx} | {name} | {t['this']:.3f} | {t['this'] / f32[ctx]:.2f}x"
                     + (f" | {t['base']:.3f} | {t['base'] / t['this']:.2f}x" if "base" in t else "") + " |")
    body = (kernel_ab.command_and_machine("bench_decode_attention.py", argparse.Namespace(
                threads=str(args.threads), base_lib=args.base_lib, rounds=args.rounds), f" --ctx {args.ctx}", loads)
            + " One ki_decode_attention call at batch 16, 16 query heads over 8 KV heads, head_dim 64, float32 "
            f"queries; best of {args.rounds} rounds of 10 calls, the libraries interleaved"
            + (", outputs bit-equal" if args.base_lib else "") + ".\n\n" + "\n".join(lines) + "\n")
    print(body)
    if not args.no_write:
        update_results("kv-cache-16bit-attention", "KV cache type: the native decode attention alone (CPU)", body)


if __name__ == "__main__":
    main()
