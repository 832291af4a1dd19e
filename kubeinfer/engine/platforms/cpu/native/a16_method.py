"""The exact A16 product of weight-only int4 / int8 checkpoints in a float32 model (a16_linear.c): the activations
rounded to bf16 as torch rounds them, nothing else rounded but float32 sums in a fixed order (a token's output
does not depend on the batch or the thread count; the portable twin gives the same bits). Kernels `cpu_int4_a16`
and `cpu_int8_a16` (linear_method.KERNELS), the float32 default where the library has a vector path (fast()). The
weight is packed at load (a16_linear.c's layout: half a byte or one byte a weight), its scales float32 and zero
points per output row and group; the float weight goes (meta).

Speed, one product on one thread (benchmarks/RESULTS.md "cpu-a16-kernel", 2026-11-27, load ~1), ms at 1 / 16
tokens, weights cold (from memory, as in a decode step) / warm (cached): [tokens, 1024] x [8192, 1024] int4 0.128 /
0.763 cold, 0.116 / 0.713 warm; [tokens, 4096] x [1024, 4096] int4 0.062 / 0.358 cold; the int8 lm_head [16384,
1024] 0.466 / 1.93 cold, 0.351 / 1.62 warm. Against the previous tiling (4 tokens a tile for both, no prefetch):
1.3-1.6x on cold weights, int8 at 16 tokens 1.4-1.6x warm or cold, int4 on warm weights 0.86-0.94x (the prefetch's
cost). The whole engine (RESULTS "quantized-decode-lmhead", 222M model, int8 lm_head): W4A16 364.5 / 1112.1 tok/s
at batch 1 / 16 against llama.cpp Q4_0's 259.7 / 879.3 (1.40x / 1.26x), W8A16 1.61x / 1.97x of Q8_0. vdpbf16ps
(two bf16 products a lane) was 1.6-1.7x float32 FMAs over weights widened through a vpermps table (int4) and
1.0-1.25x (int8, widened by sign extension)."""
from __future__ import annotations

import torch

from . import bindings, ops
from .method import PackedIntMethod

KERNELS = {"cpu_int8_a16": 8, "cpu_int4_a16": 4}
STEP = 8  # inputs per step of the kernel


def applies(kernel: str, values: torch.Tensor, scale: torch.Tensor, group_size: int, bits: int, fp8: bool) -> bool:
    """int4 or int8 (as the kernel's name), inputs a multiple of 32, one scale per row or groups of a multiple of 32
    that divide the inputs."""
    cols, groups = values.shape[1], scale.shape[1]
    grouped_ok = groups == 1 or (group_size % 32 == 0 and cols % group_size == 0 and cols // group_size == groups)
    return not fp8 and bits == KERNELS[kernel] and cols % 32 == 0 and grouped_ok


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int values (int8 storage) [N, K] -> a16_linear.c's layout, rows padded to a multiple of 16 (with zeros)."""
    n, k = values.shape
    v = torch.nn.functional.pad(values, (0, 0, 0, -n % ops.ROWS))
    groups = v.shape[0] // ops.ROWS
    if bits == 8:  # [row groups][K / 8][pair 4][rows 0-7, 8-15][8 rows][even, odd]
        v = v.view(groups, 2, 8, k // STEP, 4, 2).permute(0, 3, 4, 1, 2, 5)
        return v.contiguous().view(torch.uint8).flatten()
    u = (v.to(torch.int16) + 8).to(torch.uint8).view(groups, ops.ROWS, k // STEP, STEP)
    # each row's 32-bit word, little-endian: bytes (inputs 0, 2), (4, 6), (1, 3), (5, 7), the first of each low
    word = [u[..., a] | (u[..., b] << 4) for a, b in ((0, 2), (4, 6), (1, 3), (5, 7))]
    return torch.stack(word, dim=-1).permute(0, 2, 1, 3).contiguous().flatten()  # [row groups][K / 8][16][4]


def pack_zero(zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Zero points [N, groups] -> a16_linear.c's [row groups][groups][32]: int4 7 - zero as int16, int8 the zero as
    int32, each row twice (int8: rows 0-7, then 8-15, as the packed weight's pairs)."""
    lo, hi = (-8, 7) if bits == 4 else (-128, 127)
    if zero.numel() and (int(zero.min()) < lo or int(zero.max()) > hi):
        raise ValueError(f"int{bits} zero points must lie in [{lo}, {hi}]")
    z = ops.pack_groups(zero.to(torch.int32), torch.int32)  # [row groups][groups][16]
    z = z.repeat_interleave(2, dim=-1)
    return (7 - z).to(torch.int16).contiguous() if bits == 4 else z.contiguous()


def fast() -> bool:
    """Whether the loaded library has a vector path for the product: AVX-512 BF16 (vdpbf16ps, the v4 build) or
    AVX2 and FMA (a16_avx2.c, the v3 build; build.py picks the level). Where it has neither, the portable C twin
    would run, correct but slower than torch's products, so the default keeps torch's there."""
    lib = ops.library()
    return bool(lib is not None and lib.ki_has_a16_vector())


SIGNATURE = bindings.SIGNATURES["ki_a16_linear"]  # ki_q8_0_linear's (each pointer then its buffer's bytes)


def kernel():
    """ki_a16_linear of the loaded library (ops.kernel: looked up once per library; callers ask each call, so a
    reloaded library, the portable twin in tests, is the one called)."""
    return ops.kernel("ki_a16_linear")


def a16_linear(x: torch.Tensor, packed: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor,
               group_size: int, out_features: int) -> torch.Tensor:
    """x [..., K] times the packed weights; `scale` from ops.pack_groups (float32), `zero` from pack_zero; float32
    [..., N]."""
    return ops.packed_linear(kernel(), "A16", x, packed, bits, scale, zero, group_size, out_features)


class A16Method(PackedIntMethod):
    """A layer's packed weight as parameters (memory accounting and .to() see them), multiplied by a16_linear."""
    zero_name = "weight_zero"

    def pack(self, values: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pack(values, self.bits), pack_zero(zero, self.bits)

    def product(self, *args) -> torch.Tensor:
        return a16_linear(*args)
