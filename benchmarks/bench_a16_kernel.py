"""The exact A16 product alone (platforms/cpu/native/a16_linear.c, ki_a16_linear) on the 222M benchmark model's shapes
(bench_quantized_decode's `large`: qkv [2048, 1024], o [1024, 1024], gate_up [8192, 1024], down [1024, 4096] int4
in groups of 128, lm_head [16384, 1024] int8 per channel), at 1 and 16 tokens, on 1 or 2 threads, with the weights
warm or cold, against another build of the library with `--base-lib PATH` (kernel_ab.py, the harness).

    python benchmarks/bench_a16_kernel.py [--threads 1,2] [--base-lib PATH] [--no-write]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kernel_ab  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.engine.platforms.cpu.native import a16_method, ops  # noqa: E402

SHAPES = (("qkv", 1024, 2048, 4, 128), ("o", 1024, 1024, 4, 128), ("gate_up", 1024, 8192, 4, 128),
          ("down", 4096, 1024, 4, 128), ("lm_head", 1024, 16384, 8, None))


def case(name: str, k: int, n: int, bits: int, group: int | None) -> kernel_ab.Case:
    size = group or k

    def operands(copies: int, gen: torch.Generator) -> kernel_ab.Product:
        lo, hi = (-8, 8) if bits == 4 else (-128, 128)
        weights = kernel_ab.copies(a16_method.pack(torch.randint(lo, hi, (n, k), dtype=torch.int8, generator=gen),
                                                   bits), copies)
        zero = a16_method.pack_zero(torch.zeros(n, k // size, dtype=torch.int8), bits)
        scale = ops.pack_groups(torch.rand(n, k // size, generator=gen) + 0.01, torch.float32)

        def product(lib, x, i, out):
            lib.ki_a16_linear(x.data_ptr(), x.nbytes, x.shape[0], k, weights[i].data_ptr(), weights[i].nbytes, bits,
                              scale.data_ptr(), scale.nbytes, zero.data_ptr(), zero.nbytes, k // size, size, n,
                              out.data_ptr(), out.nbytes)
        return product
    return kernel_ab.Case(name, f"[{n}, {k}] int{bits}", k, n, operands)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    kernel_ab.add_arguments(parser)
    args = parser.parse_args()
    libs = kernel_ab.libraries(args.base_lib, {"ki_a16_linear": a16_method.SIGNATURE})
    rows, loads = kernel_ab.compare(libs, args.threads, [case(*shape) for shape in SHAPES], args.rounds)
    body = (kernel_ab.command_and_machine("bench_a16_kernel.py", args, "", loads) + " ki_a16_linear alone, "
            + kernel_ab.weights_sentence(args.rounds) + "\n\n" + kernel_ab.table(rows, bool(args.base_lib)) + "\n")
    print(body)
    if not args.no_write:
        update_results("cpu-a16-kernel", "The exact A16 product alone on the 222M model's shapes (CPU)", body)


if __name__ == "__main__":
    main()
