"""The logits product of a CPU model whose lm_head is float32 (float32 models, and the quantized checkpoints that
leave lm_head float, as llm-compressor's `ignore: [lm_head]` does; a tied embedding's too; a head the checkpoint
quantizes keeps its quant method's product) through the native float32 product
(platforms/cpu/native/f32_linear.c) in small steps: both cores through the native pool, where OpenBLAS's
product of 16 tokens ran at about one core's multiply-add peak.

Taken where: tensor parallelism off (the caller), the head float32 on the CPU without bias or quantization
method; per call, a small step (cpu_blas.py: torch on one thread, so no second pool spins beside ours), at most
f32_ops.MAX_TOKENS rows, and KUBEINFER_CPU_NATIVE_LAYERS on (ops.layers_enabled, read once a step; 0: OpenBLAS
or torch as before). The weight is read where it is (row-major, not repacked): nothing more is held, and a tied
embedding still looks its rows up. Each logit is summed in one fixed order whatever the batch (f32_linear.c):
a sequence's logits do not depend on the others in its step.

Measured (benchmarks/bench_f32_linear.py --engine, 222M model, one engine, native and OpenBLAS lm_head alternating,
load 2-4): batch 16 1.06-1.10x tok/s in the best rounds (1.65-1.77x in the medians of the quantized models:
OpenBLAS's two threads stall when other jobs hold a core), batch 1 on a par (0.96-1.04x: both read the 64 MB at
the memory's rate). benchmarks/RESULTS.md native-f32-linear."""
from __future__ import annotations

import torch
from torch import nn

from . import cpu_blas
from .native import f32_ops


def use_native_lm_head(model: nn.Module) -> bool:
    """Route `model.lm_head` through the native product where it applies (see above); whether it did."""
    head = getattr(model, "lm_head", None)
    if (not isinstance(head, nn.Linear) or hasattr(head, "quant_method") or head.bias is not None
            or head.weight.device.type != "cpu" or head.weight.dtype != torch.float32
            or not f32_ops.supports(head.weight)):
        return False
    previous = head.forward  # OpenBLAS's (cpu_blas.py) or torch's
    params = head._parameters  # not Module.__getattr__: read each call, so a swapped weight is seen

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = params["weight"]
        if cpu_blas.in_small_step() and f32_ops.wants(x) and weight.is_contiguous():
            return f32_ops.f32_linear(x, weight)
        return previous(x)
    forward.previous = previous  # benchmarks put it back for an A/B in one engine
    head.forward = forward
    return True
