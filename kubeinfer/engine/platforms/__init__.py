"""What differs by device. platforms/cpu: the native C library (native/: its sources with one header, the ctypes
bindings declared once, its build), CPU decode attention, fused norm/activation/rotary, BLAS threading, the two
cores' split and the decoder fast path; platforms/cuda: CUDA graphs and the Triton attention and norms.

Models reach a backend through the hooks below, never by importing platforms.cpu or platforms.cuda (a layout
test holds it), so a model definition stays one device-neutral description of its arithmetic."""
from __future__ import annotations

import torch


def decoder_fast_path(model, x: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta, lora
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The model's decoder layers of this step run by the platform in one call per run of layers: (output,
    residual) as the layer loop gives, or None where the platform has no fast path for this step (the model
    loops over its layers). The CPU's: platforms/cpu/native_decode.py."""
    if not x.is_cpu:
        return None
    from .cpu import native_decode
    return native_decode.forward_layers(model, x, positions, kv_caches, meta, lora)


def fused_silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor | None:
    """silu(gate) * up of a fused gate/up projection's output in one pass where the platform has one, else None
    (the caller computes it in torch). The CPU's: platforms/cpu/cpu_fused_ops.py."""
    if not gate_up.is_cpu:
        return None
    from .cpu import cpu_fused_ops
    return cpu_fused_ops.silu_mul(gate_up, intermediate)
