"""AWQ checkpoints (`quant_method: awq`, AutoAWQ's GEMM layout): per linear layer `qweight` [in, out / 8] int32
(the transposed weight's unsigned 4-bit values, eight per word in AWQ's interleaved order, packing.py's AWQ_ORDER),
`qzeros` [in / group_size, out / 8] packed alike, and `scales` [in / group_size, out]. The weight is
(q - zero) * scale per group of `group_size` input rows; `zero_point: false` means a zero of 8. Served by
dequantizing at load (float32, then the model dtype)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import QuantizationError
from .packing import awq_unpack_columns, qweight_key


@dataclass(frozen=True)
class AwqConfig:
    method = "awq"
    group_size: int
    zero_point: bool

    @classmethod
    def from_dict(cls, qc: dict) -> AwqConfig:
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4:
            raise QuantizationError(f"awq checkpoint with {bits}-bit weights: only 4-bit AWQ is served")
        if version != "gemm":
            raise QuantizationError(f"awq checkpoint in the {version!r} layout: only AutoAWQ's 'gemm' layout is served")
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if group < 1:
            raise QuantizationError(f"awq group_size must be positive, got {group}")
        return cls(group, bool(qc.get("zero_point", True)))

    def describe(self) -> str:
        return f"awq int4 group {self.group_size}, weights dequantized to the model dtype"

    @staticmethod
    def auxiliary(key: str) -> bool:
        return key.endswith((".qzeros", ".scales"))

    weight_key = staticmethod(qweight_key)

    def read(self, key: str, tensor: torch.Tensor, get) -> torch.Tensor:
        if not key.endswith(".qweight"):
            return tensor
        values, zero, scales = self._integers(key, tensor, get)
        rows = values.shape[0]
        expand = lambda g: g.to(torch.float32).repeat_interleave(self.group_size, dim=0)[:rows]
        return ((values.to(torch.float32) - expand(zero)) * expand(scales)).t().contiguous()

    def int_weight(self, key: str, tensor: torch.Tensor, get):
        """The weight as signed integers [out, in] for a kept-quantized layer (linear_method.IntWeight)."""
        from .linear_method import IntWeight

        if not key.endswith(".qweight"):
            return None
        values, zero, scales = self._integers(key, tensor, get)
        return IntWeight((values - 8).t().to(torch.int8).contiguous(), scales.t().to(torch.float32).contiguous(),
                         (zero - 8).t().to(torch.int8).contiguous(), self.group_size, 4)

    def checkpoint_slice(self, key: str, lazy, get, dim: int, start: int, length: int):
        """A tensor-parallel rank's part read from the file (`lazy`: get_slice): dim 0, output features (qweight's
        and qzeros' columns, eight a word); dim 1, input rows on group boundaries. (qweight, get), or None
        where the cut falls inside a word or group (the loader cuts the whole weight instead)."""
        if not key.endswith(".qweight"):
            return None
        module, end, group = key[:-len(".qweight")], start + length, self.group_size
        scales, zeros = get(f"{module}.scales"), get(f"{module}.qzeros")
        if scales is None:
            return None
        if dim == 0 and not (start % 8 or length % 8):
            tensor, scales = lazy[:, start // 8:end // 8], scales[:, start:end]
            zeros = None if zeros is None else zeros[:, start // 8:end // 8]
        elif dim == 1 and not (start % group or length % group):
            tensor, scales = lazy[start:end], scales[start // group:end // group]
            zeros = None if zeros is None else zeros[start // group:end // group]
        else:
            return None
        parts = {f"{module}.scales": scales, f"{module}.qzeros": zeros}
        return tensor, lambda k: parts[k] if k in parts else get(k)

    def _integers(self, key: str, tensor: torch.Tensor, get):
        """Unsigned values [in, out], zeros and scales [in / group_size, out]."""
        module = key[:-len(".qweight")]
        scales, zeros = get(f"{module}.scales"), get(f"{module}.qzeros")
        if scales is None or (self.zero_point and zeros is None):
            raise QuantizationError(f"awq weight {key!r} has no {'scales' if scales is None else 'qzeros'} "
                                    "in the checkpoint")
        values = awq_unpack_columns(tensor)  # [in, out]
        rows = values.shape[0]
        groups = -(-rows // self.group_size)
        if scales.shape != (groups, values.shape[1]):
            raise QuantizationError(f"awq scales of {module} have shape {tuple(scales.shape)}; a {rows}-row qweight "
                                    f"in groups of {self.group_size} needs {(groups, values.shape[1])}")
        zero = awq_unpack_columns(zeros) if self.zero_point else torch.full(scales.shape, 8, dtype=torch.int32)
        if zero.shape != scales.shape:
            raise QuantizationError(f"awq qzeros of {module} unpack to {tuple(zero.shape)}, not {tuple(scales.shape)}")
        return values, zero, scales
