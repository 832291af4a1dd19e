"""The torch-facing side of f32_linear.c: float32 `out = x @ w.T` for small batches on the native pool (both
cores), the weights read in their own row-major layout. Each output element is summed in one fixed order
(f32_linear.c), so a token's logits do not depend on the batch size or the thread count, and the portable twin
gives the same bits.

Used for the lm_head (platforms/cpu/native_lm_head.py) and for a float32 model's projections in steps of 2-16 tokens
(platforms/cpu/cpu_blas.py): every projection native was 1.47-1.51x tok/s at batch 16 but 0.89-0.98x at batch 1, where
OpenBLAS reads one token's weights faster, and OpenBLAS's blocked gemm wins from 32 tokens. Figures:
benchmarks/RESULTS.md "native-f32-linear"."""
from __future__ import annotations


import torch

from . import bindings, ops

MAX_TOKENS = 64  # larger products (prefill) keep torch's / OpenBLAS's blocked GEMM


SIGNATURE = bindings.SIGNATURES["ki_f32_linear"]  # each pointer then its buffer's bytes


def _kernel():
    """ki_f32_linear (ops.kernel: looked up once per loaded library), None where none is built."""
    return ops.kernel("ki_f32_linear")


def supports(weight: torch.Tensor) -> bool:
    """A weight this product takes: float32 on the CPU, contiguous rows, and the library built."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.is_contiguous() and _kernel() is not None)


def f32_linear(x: torch.Tensor, weight: torch.Tensor, threads: int = 0) -> torch.Tensor:
    """x [..., K] float32 @ weight [N, K]^T -> [..., N] float32; `threads` 1: on the calling thread alone."""
    k = x.shape[-1]
    flat = x.dim() == 2
    rows = x if flat else x.reshape(-1, k)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    n = weight.shape[0]
    out = rows.new_empty(rows.shape[0], n)
    if rows.shape[0] and n:
        ops.check(_kernel()(rows.data_ptr(), rows.nbytes, rows.shape[0], k, weight.data_ptr(), weight.nbytes,
                            n, out.data_ptr(), out.nbytes, threads), "float32 linear")
    return out if flat else out.view(*x.shape[:-1], n)


def wants(x: torch.Tensor) -> bool:
    """Whether this call goes native: the layers switch on (ops.layers_enabled) and a small float32 batch."""
    return (x.dtype is torch.float32 and x.numel() <= MAX_TOKENS * x.shape[-1] and not x.requires_grad
            and ops.layers_enabled())
