"""Projection weights stored column-major on the CPU, for faster one-token matmuls.

A checkpoint's [out, in] weight is row-major, so `F.linear(x, W)` computes `x @ W.t()` through a
transposed GEMV at one token, which streams the weights here 1.4-1.7x slower than the plain GEMV MKL
runs when `W.t()` is contiguous (the wide q/k/v, gate/up and lm_head matrices gain most; see
benchmarks/bench_cpu_gemv.py). Each parameter keeps its [out, in] shape and only its strides change, so every reader (LoRA, tied
embeddings, the loader) sees the same tensor; no extra memory. Only float32: bf16 products go through
oneDNN, which is 1.3-1.8x slower with column-major weights here. The trade-off: at 64 tokens and in
prefill both layouts run alike, but with 2 threads 16-token products ran about 25% slower column-major
(with 1 thread, faster); a deployment that never decodes one
sequence alone can keep the checkpoint's layout with KUBEINFER_CPU_COLUMN_MAJOR_WEIGHTS=0.
"""
from __future__ import annotations

import os

import torch
from torch import nn


def use_column_major_weights(model: nn.Module) -> None:
    """On the CPU in float32, re-lay each nn.Linear weight (a tied one once) so that `weight.t()` is contiguous."""
    if os.environ.get("KUBEINFER_CPU_COLUMN_MAJOR_WEIGHTS", "1") == "0":
        return
    for module in model.modules():
        weight = getattr(module, "weight", None) if isinstance(module, nn.Linear) else None
        if (weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32
                and weight.dim() == 2 and weight.is_contiguous()):
            with torch.no_grad():
                weight.data = weight.data.t().contiguous().t()
