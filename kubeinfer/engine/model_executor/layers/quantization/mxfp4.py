"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints store their expert weights: `*_blocks` [..., G, 16]
uint8 holding 32 FP4 (e2m1) values per group, two per byte, low nibble first; `*_scales` [..., G] uint8, a
power-of-two exponent per group biased by 127. Dequantized once at load into the model's dtype."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import QuantizationError

# The sixteen e2m1 values by their 4-bit code: sign bit, two exponent bits, one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32


@dataclass(frozen=True)
class Mxfp4Config:
    method = "mxfp4"
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, qc: dict) -> Mxfp4Config:
        return cls(tuple(qc.get("modules_to_not_convert") or ()))

    def describe(self) -> str:
        return "mxfp4 (expert weights, dequantized at load)"

    # The loader's interface to a format (fp8.py has the same): gpt-oss's expert loader reads each `*_blocks`
    # with its `*_scales` and dequantizes them (models/gpt_oss.py); every other tensor is stored as it is used.
    @staticmethod
    def auxiliary(key: str) -> bool:
        return False

    @staticmethod
    def weight_key(key: str) -> str:
        return key

    def read(self, key: str, tensor: torch.Tensor, get) -> torch.Tensor:
        return tensor


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
               name: str = "weight") -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] of `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise QuantizationError(f"mxfp4 weight {name}: blocks and scales must be uint8, got {blocks.dtype} and "
                                f"{scales.dtype}")
    if blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise QuantizationError(f"mxfp4 weight {name}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
                                f"do not pair up (expected [..., G, {GROUP // 2}] and [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].reshape(*blocks.shape[:-1], GROUP)
    out = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return out.reshape(*blocks.shape[:-2], -1).to(dtype)
