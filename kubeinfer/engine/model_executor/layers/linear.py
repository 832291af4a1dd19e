"""Projections split across the ranks of a tensor-parallel group (kubeinfer/engine/distributed/parallel_state.py).

Column-parallel layers hold a slice of the output features: each rank computes its own columns and no
collective runs (the attention heads and MLP columns that follow are split alike). A fused projection
(q/k/v, gate/up) is split part by part, so each rank holds its q heads, its KV heads and its gate and up
columns side by side. Row-parallel layers hold a slice of the input features, so their products are
partial sums: one all-reduce adds them, and the bias is added once, after it.

Both are nn.Linear: F.linear is the local product, so whatever replaces a plain layer's product can replace
theirs: OpenBLAS on the CPU (one rank only), and kept-quantized int weights, which a column-parallel layer
multiplies through its replaced forward and a row-parallel one through `product` (its quant method's
`apply`), the collective staying outside it (`partial`, then `reduce`). In a group of one they are plain
nn.Linear.

Weights are cut at load: `weight_pieces` takes the checkpoint's whole tensor, or a lazy view of it whose
`narrow` reads only the slice (model_loader.py), or an int weight (quantization/linear_method.IntWeight, whose
`narrow` cuts its integers, scales and zeros alike), and says which of this rank's slices goes where."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config import Part
from ...distributed.parallel_state import all_reduce


class ColumnParallelLinear(nn.Linear):
    def __init__(self, in_features: int, parts: list[Part], bias: bool) -> None:
        super().__init__(in_features, sum(p.size for p in parts), bias=bias)
        self.parts = parts

    def weight_pieces(self, param: torch.Tensor, source, shard: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(slice of `param`, this rank's rows of the checkpoint tensor) pairs. `shard`: which part the tensor
        is (q, k or v; gate or up); None: all parts fused in one tensor (Phi-3), each at its checkpoint offset."""
        pieces, local, checkpoint = [], 0, 0
        for index, part in enumerate(self.parts):
            if shard is None:
                pieces.append((param.narrow(0, local, part.size), source.narrow(0, checkpoint + part.start, part.size)))
            elif index == shard:
                pieces.append((param.narrow(0, local, part.size), source.narrow(0, part.start, part.size)))
            local, checkpoint = local + part.size, checkpoint + part.total
        return pieces


class RowParallelLinear(nn.Linear):
    calls_quant_method = True  # its forward multiplies through `product` (linear_method.attach leaves it)

    def __init__(self, input_part: Part, out_features: int, bias: bool, tp_size: int) -> None:
        """`input_part`: this rank's input features (the heads or MLP columns the layer before it computed)."""
        super().__init__(input_part.size, out_features, bias=bias)
        self.input_part, self.tp_size = input_part, tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.product(x, bias=True)
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the product: its input columns, no bias."""
        return self.product(x, bias=False)

    def product(self, x: torch.Tensor, bias: bool) -> torch.Tensor:
        """The local product: a kept-quantized weight's quant method where one is attached
        (layers/quantization/linear_method.py, which leaves this class's forward in place), else F.linear."""
        method = getattr(self, "quant_method", None)
        if method is not None:
            return method.apply(self, x, bias)
        return F.linear(x, self.weight, self.bias if bias else None)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The ranks' shares summed, then the bias (once)."""
        out = all_reduce(partial)
        return out if self.bias is None else out.add_(self.bias)

    def weight_pieces(self, param: torch.Tensor, source, shard: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if param is self.bias:  # whole on every rank, added after the sum
            return [(param, source.narrow(0, 0, source.shape[0]))]
        return [(param, source.narrow(1, self.input_part.start, self.input_part.size))]
