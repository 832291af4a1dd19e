"""The native W4A8 product alone (platforms/cpu/native/w4a8_linear.c, ki_w4a8_f32: per-token int8 quantization, then
the int4
x int8 product) on the 222M benchmark model's shapes (bench_quantized_decode's `large`: qkv [2048, 1024], o [1024,
1024], gate_up [8192, 1024], down [1024, 4096], int4 symmetric in groups of 128, as bench_w4a8_decode's checkpoint),
at 1 and 16 tokens, on 1 or 2 threads, weights warm or cold, against another build of the library with
`--base-lib PATH` (kernel_ab.py, the harness). `--w8a8`: the W8A8 int8 product
(kernels.c's ki_w8a8: int8 weights per channel, int8 activations) on the same shapes instead (its own section).

    python benchmarks/bench_w4a8_kernel.py [--threads 1,2] [--base-lib PATH] [--w8a8] [--no-write]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kernel_ab  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.engine.platforms.cpu.native import bindings, ops, w4a8_ops  # noqa: E402

SHAPES = (("qkv", 1024, 2048), ("o", 1024, 1024), ("gate_up", 1024, 8192), ("down", 4096, 1024))
GROUP = 128
SIGNATURES = {name: bindings.SIGNATURES[name] for name in ("ki_w4a8_f32", "ki_w8a8")}  # with buffer lengths


def w4a8_case(name: str, k: int, n: int) -> kernel_ab.Case:
    def operands(copies: int, gen: torch.Generator) -> kernel_ab.Product:
        w = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
        packed, scale = w4a8_ops.pack(w, torch.rand(n, k // GROUP, generator=gen) + 0.01)
        weights = kernel_ab.copies(packed, copies)

        def product(lib, x, i, out):
            status = lib.ki_w4a8_f32(x.data_ptr(), x.nbytes, x.shape[0], k, weights[i].data_ptr(), weights[i].nbytes,
                                     scale.data_ptr(), scale.nbytes, scale.shape[1], GROUP, n, out.data_ptr(),
                                     out.nbytes)
            assert status == 0, status
        return product
    return kernel_ab.Case(name, f"[{n}, {k}]", k, n, operands)


def w8a8_case(name: str, k: int, n: int) -> kernel_ab.Case:
    def operands(copies: int, gen: torch.Generator) -> kernel_ab.Product:
        weights = kernel_ab.copies(ops.pack_int8(torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)),
                                   copies)
        scale = torch.rand(n, generator=gen) + 0.01
        quantized = {}  # per token count: the activations quantized once, outside the timing, alike for every library

        def product(lib, x, i, out):
            m = x.shape[0]
            if m not in quantized:
                tokens = torch.Generator().manual_seed(m * k)
                quantized[m] = (torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=tokens),
                                torch.rand(m, generator=tokens))
            q, sx = quantized[m]
            status = lib.ki_w8a8(q.data_ptr(), q.nbytes, sx.data_ptr(), sx.nbytes, m, k, weights[i].data_ptr(),
                                 weights[i].nbytes, scale.data_ptr(), scale.nbytes, n, out.data_ptr(), out.nbytes)
            assert status == 0, status
        return product
    return kernel_ab.Case(name, f"[{n}, {k}]", k, n, operands)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    kernel_ab.add_arguments(parser)
    parser.add_argument("--w8a8", action="store_true", help="time ki_w8a8 (int8 weights) instead")
    args = parser.parse_args()
    libs = kernel_ab.libraries(args.base_lib, SIGNATURES)
    cases = [(w8a8_case if args.w8a8 else w4a8_case)(*shape) for shape in SHAPES]
    rows, loads = kernel_ab.compare(libs, args.threads, cases, args.rounds)
    what = ("ki_w8a8 alone (int8 weights per channel, the activations quantized before)" if args.w8a8 else
            f"ki_w4a8_f32 alone (int4 in groups of {GROUP}, activations quantized per token inside)")
    body = (kernel_ab.command_and_machine("bench_w4a8_kernel.py", args, " --w8a8" if args.w8a8 else "", loads)
            + f" {what}, " + kernel_ab.weights_sentence(args.rounds) + "\n\n"
            + kernel_ab.table(rows, bool(args.base_lib)) + "\n")
    print(body)
    if not args.no_write:
        if args.w8a8:
            update_results("cpu-w8a8-kernel", "The native W8A8 int8 product alone on the 222M model's shapes (CPU)",
                           body)
        else:
            update_results("cpu-w4a8-kernel", "The native W4A8 product alone on the 222M model's shapes (CPU)", body)


if __name__ == "__main__":
    main()
