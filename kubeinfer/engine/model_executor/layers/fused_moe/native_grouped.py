"""The experts' float32 products on the native pool (platforms/cpu/native/f32_linear.c's ki_f32_grouped_linear): the
rows sorted by expert times every expert's weight in one call, each (expert, group of output rows) a work item of
the pool. In a decode step each expert has a row or a few, where torch's grouped product runs one GEMM per expert
(each a slice, a `.item()` and a kernel launch on one thread pool): hundreds of small calls a step.

Each element is summed in ki_f32_linear's fixed order (the dense projections' order in small steps), so an expert's
row does not depend on how many other rows the step has. Prefill chunks' groups of up to
MAX_ROWS_PER_EXPERT rows take it too; larger ones keep torch's blocked GEMMs."""
from __future__ import annotations

import torch

from ....platforms.cpu.native import ops

# Measured (32 experts [384, 512], top-4, 2 shared cores, under load): native 3.5 ms vs torch's grouped 458 ms at
# 64 tokens, 54 vs 77 ms at 512, 113 vs 220 ms at 1100 (~140 rows an expert; a random router's prefill chunk
# of 1167 tokens gave an expert up to 588 rows). Past this bound torch's GEMM.
MAX_ROWS_PER_EXPERT = 1024


def serves(x: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> bool:
    """float32 rows and stacks on the CPU, small groups, the native layers on and the library built."""
    return (x.dtype is torch.float32 and weights.dtype is torch.float32 and x.device.type == "cpu"
            and weights.is_contiguous() and max(counts, default=0) <= MAX_ROWS_PER_EXPERT
            and ops.layers_enabled() and ops.kernel("ki_f32_grouped_linear") is not None)


def grouped_linear(x: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 sorted by expert; weights [E, N, K]; ends int32 [E] (expert e's rows end at ends[e])
    -> [M, N] = each row times its expert's weight, transposed."""
    x = x if x.is_contiguous() else x.contiguous()
    experts, n, k = weights.shape
    out = x.new_empty(x.shape[0], n)
    if x.shape[0]:
        ops.check(ops.kernel("ki_f32_grouped_linear")(
            x.data_ptr(), x.nbytes, x.shape[0], k, weights.data_ptr(), weights.nbytes, experts, n,
            ends.data_ptr(), ends.nbytes, out.data_ptr(), out.nbytes, 0), "grouped float32 linear")
    return out
