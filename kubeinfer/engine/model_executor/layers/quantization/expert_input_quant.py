"""Activation quantization inside the experts (W8A8 MoE checkpoints, FP8 ones, `--quantization fp8`), exact to
the reference's per-expert layers, each of which fake-quantizes its own input (layers/quantization/
activations.py):

- gate_proj / up_proj read the token's hidden state, so a dynamic per-token or per-token-group scale is the
  same for every expert the token goes to: the hidden states are quantized once, before the first product
  (as are static ones when every expert's scale is the same); different static scales per expert quantize
  each (token, expert) row with its expert's scale;
- down_proj reads that expert's intermediate row for the token: each (token, expert) row is quantized before
  the second product (dynamic scales per row, or its expert's static scale).

Elementwise and per-row operations, so quantizing the whole [rows, D] block at once gives the bits the
reference's one-expert-at-a-time calls give. A layer without it (`FusedMoE.input_quant is None`) runs no code
here: float models are untouched."""
from __future__ import annotations

import torch
from torch import nn

from .activations import ActivationScheme, fake_quantize


class ExpertInputQuant(nn.Module):
    """The schemes of one MoE layer's two expert inputs (None: that input stays float) and, for static ones,
    the scales (and zero points) as buffers: [E], one per expert, or [1] when every expert has the same."""

    def __init__(self, gate_up: ActivationScheme | None, down: ActivationScheme | None,
                 scales: dict[str, tuple[torch.Tensor, torch.Tensor | None]], down_range=None) -> None:
        """`down_range`: activations.dynamic_qparams' `reduce_range` for the down input (under tensor
        parallelism, a rank's slice of each intermediate row made whole: quantization/w8a8_tp.py)."""
        super().__init__()
        self.schemes = {"gate_up": gate_up, "down": down}
        self.ranges = {"gate_up": None, "down": down_range}
        for which, (scale, zero) in scales.items():
            self.register_buffer(f"{which}_input_scale", scale, persistent=False)
            if zero is not None:
                self.register_buffer(f"{which}_input_zero_point", zero, persistent=False)

    def extra_repr(self) -> str:
        return ", ".join(f"{which}={'float' if s is None else s.describe()}" for which, s in self.schemes.items())

    def _static(self, which: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return getattr(self, f"{which}_input_scale", None), getattr(self, f"{which}_input_zero_point", None)

    def hidden(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [T, H] as every expert's gate/up multiplies it, quantized once; None when the static scales differ
        per expert (then `hidden_rows` per (token, expert) row)."""
        scheme = self.schemes["gate_up"]
        if scheme is None:
            return x
        scale, zero = self._static("gate_up")
        if scale is not None and scale.numel() > 1:
            return None
        return fake_quantize(x, scheme, scale, zero)

    def hidden_rows(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """rows [n, H]: a token's hidden state once per expert it goes to (`experts` [n]), each quantized with
        its expert's static scale."""
        return self._rows(rows, experts, "gate_up")

    def intermediate(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """rows [n, I]: each (token, expert) intermediate row as that expert's down_proj quantizes it."""
        return self._rows(rows, experts, "down")

    def _rows(self, rows: torch.Tensor, experts: torch.Tensor, which: str) -> torch.Tensor:
        scheme = self.schemes[which]
        if scheme is None:
            return rows
        scale, zero = self._static(which)
        if scale is not None and scale.numel() > 1:  # each row its expert's scale: the same x / s per element
            scale = scale.index_select(0, experts).unsqueeze(1)
            zero = None if zero is None else zero.index_select(0, experts).unsqueeze(1)
        return fake_quantize(rows, scheme, scale, zero, reduce_range=self.ranges[which])
