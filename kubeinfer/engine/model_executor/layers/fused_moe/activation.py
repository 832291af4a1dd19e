"""The experts' activations, [n, 2I] gate-then-up -> [n, I]: SiLU(gate) * up, and gpt-oss's clamped SwiGLU."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(alpha: float, limit: float):
    """gpt-oss's activation: gate clamped from above, up clamped both ways, (up + 1) * gate * sigmoid(alpha gate)."""
    def activation(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return activation
