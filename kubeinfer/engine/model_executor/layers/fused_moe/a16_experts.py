"""MoE experts kept int4 / int8 through the exact A16 product (platforms/cpu/native/a16_method.py, a16_linear.c), the
kernels `cpu_int4_a16` / `cpu_int8_a16` that a float32 model's dense layers take by default where the native
library builds with AVX-512 BF16: each expert packed at load in a16_linear.c's layout (its rows padded to a
multiple of 16), and each active expert's rows of a step multiplied by `ki_a16_linear`, the dense layers' very
entry point: the activations rounded to bf16 as torch rounds them, nothing else rounded, float32 sums in one
fixed order per output (a token's output does not depend on the batch: batch-invariant), written straight into
the step's rows (no copy).

Parameters on the FusedMoE, per projection (gate_up, down): `{which}_qweight` [E, packed bytes] uint8,
`{which}_scale` [E, row groups, groups, 16] float32 and `{which}_zero` [E, row groups, groups, 32] (int4: int16
7 - zero; int8: int32), zeros held for symmetric weights too (as the dense A16 layers hold them)."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ....platforms.cpu.native import a16_method, ops
from ..quantization.linear_method import IntWeight

KERNELS = a16_method.KERNELS  # {"cpu_int8_a16": 8, "cpu_int4_a16": 4}
SUFFIXES = ("qweight", "scale", "zero")


def pack(weight: IntWeight) -> dict[str, torch.Tensor]:
    """A stack of experts [E, N, K] in a16_linear.c's layout, one expert at a time (a16_method.pack's)."""
    zero = weight.zero if weight.zero is not None else torch.zeros_like(weight.scale, dtype=torch.int8)
    per_expert = [(a16_method.pack(v, weight.bits), ops.pack_groups(s, torch.float32),
                   a16_method.pack_zero(z, weight.bits)) for v, s, z in zip(weight.values, weight.scale, zero)]
    return {suffix: torch.stack([p[i] for p in per_expert]).contiguous() for i, suffix in enumerate(SUFFIXES)}


def register_stacks(moe: nn.Module, weights: dict[str, IntWeight], pack: Callable[[IntWeight], dict],
                    device: torch.device) -> dict[str, tuple]:
    """Each projection's expert stacks, `pack(weight)` ({suffix: [E, ...]}), registered on the layer as parameters
    `{which}_{suffix}` (memory accounting and .to() see them). Returns the products' layout: which -> (parameter
    names, bytes per expert of each, out rows N, inputs K, groups, group size), each expert's block found by its
    byte offset in the stacks."""
    layout = {}
    for which, weight in weights.items():
        n, k = weight.values.shape[1:]
        groups = weight.scale.shape[-1]
        packed = pack(weight)
        for suffix, tensor in packed.items():
            moe.register_parameter(f"{which}_{suffix}", nn.Parameter(tensor.to(device), requires_grad=False))
        layout[which] = (tuple(f"{which}_{s}" for s in packed), tuple(t[0].numel() * t.element_size()
                                                                       for t in packed.values()),
                         n, k, groups, k if groups == 1 else weight.group_size)
    return layout


class A16Experts:
    """One MoE layer's experts packed for ki_a16_linear (registered on the layer as parameters: memory accounting
    and .to() see them); `product` is grouped.py's per-expert product."""

    def __init__(self, moe: nn.Module, weights: dict[str, IntWeight], device: torch.device) -> None:
        self.bits = weights["gate_up"].bits
        self.layout = register_stacks(moe, weights, pack, device)

    def product(self, moe: nn.Module, which: str, expert: int, rows: torch.Tensor, out: torch.Tensor,
                bias: torch.Tensor | None) -> None:
        """out = rows @ W[expert].T (+ bias), float32, written in place (a copy only where `out` is not a
        contiguous float32 block). Each expert's block found by its byte offset in the (contiguous) stacks: no
        view made (~1 us each; a step makes two calls per active expert)."""
        names, sizes, n, k, groups, group = self.layout[which]
        params = moe._parameters  # Module.__getattr__ costs ~0.4 us a name
        q, s, z = (params[name].data_ptr() + expert * size for name, size in zip(names, sizes))
        if rows.dtype is not torch.float32 or not rows.is_contiguous():
            rows = rows.to(torch.float32).contiguous()
        direct = out.dtype is torch.float32 and out.is_contiguous()
        target = out if direct else rows.new_empty(rows.shape[0], n)
        m = rows.shape[0]
        if m:  # each expert's block `sizes` bytes long: the kernel refuses dimensions that reach past one
            ops.check(a16_method.kernel()(rows.data_ptr(), rows.nbytes, m, k, q, sizes[0], self.bits, s, sizes[1],
                                          z, sizes[2], groups, group, n, target.data_ptr(), target.nbytes), "A16")
        if not direct:
            out.copy_(target)
        if bias is not None:
            out.add_(bias)
