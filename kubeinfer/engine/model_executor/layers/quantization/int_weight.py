"""A checkpoint's integer (or e4m3) weight as the kept-quantized layers take it: values, scales and zero points
per output row and group of input columns, joined for fused projections and cut for tensor-parallel ranks."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class IntWeight:
    """A checkpoint's integer weight: values (signed, int8 storage) [out, in], scale [out, groups] (float32)
    and zero [out, groups] (signed, int8; None when symmetric), groups of `group_size` input columns. `fp8`:
    the values are float8_e4m3fn (bits 8, no zero), the weight values * scale."""
    values: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int
    bits: int
    fp8: bool = False

    @staticmethod
    def cat(parts: list[IntWeight]) -> IntWeight:
        """Fused projections (q/k/v, gate/up): the parts stacked along the output rows."""
        first = parts[0]
        if any(p.group_size != first.group_size or p.bits != first.bits or p.fp8 != first.fp8 for p in parts):
            raise ValueError("fused projections quantized with different groups or bits")
        zeros = None if all(p.zero is None for p in parts) else torch.cat(
            [p.zero if p.zero is not None else torch.zeros_like(p.scale, dtype=torch.int8) for p in parts])
        values = torch.cat([p.values.view(torch.uint8) if p.fp8 else p.values for p in parts])
        return IntWeight(values.view(first.values.dtype), torch.cat([p.scale for p in parts]), zeros,
                         first.group_size, first.bits, first.fp8)

    def narrow(self, dim: int, start: int, length: int) -> IntWeight:
        """A tensor-parallel rank's slice, copied (the whole tensor is not kept): dim 0 cuts output rows
        (column-parallel layers) with their scales and zeros; dim 1 cuts input columns (row-parallel layers).
        A column slice that does not fall on group boundaries is regrouped exactly: its groups become
        gcd(group_size, start, length) columns, each inside one checkpoint group, with that group's scale
        and zero (more scale columns, the same weight)."""
        if dim == 0:
            cut = lambda t: None if t is None else _copy(t.narrow(0, start, length))
            return IntWeight(cut(self.values), cut(self.scale), cut(self.zero), self.group_size, self.bits, self.fp8)
        cols, size = self.values.shape[1], self.group_size
        aligned = start % size == 0 and (length % size == 0 or start + length == cols)
        group = size if aligned else math.gcd(size, start, length)
        index = (start + torch.arange(0, length, group)) // size  # the checkpoint group of each local group
        pick = lambda t: None if t is None else _copy(t.index_select(1, index.to(t.device)))
        return IntWeight(_copy(self.values.narrow(1, start, length)), pick(self.scale), pick(self.zero), group,
                         self.bits, self.fp8)

    def expand(self, grid: torch.Tensor) -> torch.Tensor:
        """A [..., N, groups] grid spread to one entry per input column, float32."""
        return grid.to(torch.float32).repeat_interleave(self.group_size, dim=-1)[..., :self.values.shape[-1]]

    def dequantize(self) -> torch.Tensor:
        """float32 [..., N, K]: one weight, or the experts' stack (fused_moe/int_experts.py)."""
        w = self.values.to(torch.float32)
        if self.zero is not None:
            w = w - self.expand(self.zero)
        return w * self.expand(self.scale)


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)
