"""GPTQ checkpoints (`quant_method: gptq`, AutoGPTQ/GPTQModel): per linear layer `qweight` [in * bits / 32, out]
int32 (the transposed weight's unsigned values packed along the input rows, value j of a word at bits
j * bits), `qzeros` [groups, out * bits / 32] packed along the output columns, `scales` [groups, out] and
`g_idx` [in] (the group of each input row). The weight is (q - zero) * scale of the row's group, where the
stored zero is one less than the true one in the original `checkpoint_format: gptq` (v1) and the true one in
`gptq_v2`. `desc_act: true` (act-order) is served: g_idx names each row's group, whatever order. 4 and 8 bits
(2 too); `group_size: -1` is one group per column. Served by dequantizing at load."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import QuantizationError
from .packing import qweight_key, unpack_columns, unpack_rows


@dataclass(frozen=True)
class GptqConfig:
    method = "gptq"
    bits: int
    group_size: int  # -1: one group over all input rows
    desc_act: bool
    zero_offset: int  # 1 for checkpoint_format gptq (v1): stored zeros are one less

    @classmethod
    def from_dict(cls, qc: dict) -> GptqConfig:
        bits = int(qc.get("bits", 4))
        if bits not in (2, 4, 8):
            raise QuantizationError(f"gptq checkpoint with {bits}-bit weights: 2, 4 and 8 bits are served")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantizationError(f"gptq checkpoint_format {fmt!r} is not served; 'gptq' and 'gptq_v2' are")
        # GPTQModel's per-module `dynamic` rules: "-:pattern" skips modules (stored float, read as float, as the
        # MoE routers are); other rules override bits or groups per module, which one config cannot read
        overrides = [rule for rule, values in (qc.get("dynamic") or {}).items() if not rule.startswith("-:") and values]
        if overrides:
            raise QuantizationError(f"gptq checkpoint with per-module overrides (dynamic: {', '.join(overrides)}) is "
                                    "not served yet; only '-:' rules (modules left unquantized) are")
        return cls(bits, int(qc.get("group_size", 128)), bool(qc.get("desc_act", False)), int(fmt == "gptq"))

    def describe(self) -> str:
        group = "channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"gptq int{self.bits} {group}{' act-order' if self.desc_act else ''}, weights dequantized to the model dtype"

    @staticmethod
    def auxiliary(key: str) -> bool:
        return key.endswith((".qzeros", ".scales", ".g_idx"))

    weight_key = staticmethod(qweight_key)

    def read(self, key: str, tensor: torch.Tensor, get) -> torch.Tensor:
        if not key.endswith(".qweight"):
            return tensor
        values, zero, scales, g_idx = self._integers(key, tensor, get)
        rows_group = g_idx.long()
        w = (values.to(torch.float32) - zero.to(torch.float32).index_select(0, rows_group)) \
            * scales.to(torch.float32).index_select(0, rows_group)
        return w.t().contiguous()

    def int_weight(self, key: str, tensor: torch.Tensor, get):
        """Signed integers [out, in] for a kept-quantized layer, when every row's group is row // group_size
        (act-order checkpoints whose g_idx is not are dequantized by read())."""
        from .linear_method import IntWeight

        if not key.endswith(".qweight"):
            return None
        values, zero, scales, g_idx = self._integers(key, tensor, get)
        rows = values.shape[0]
        size = rows if self.group_size == -1 else self.group_size
        if not torch.equal(g_idx.long(), torch.arange(rows) // size) or zero.min() < 0 or zero.max() >= 1 << self.bits:
            return None
        offset = 1 << (self.bits - 1)
        return IntWeight((values - offset).t().to(torch.int8).contiguous(), scales.t().to(torch.float32).contiguous(),
                         (zero - offset).t().to(torch.int8).contiguous(), size, self.bits)

    def checkpoint_slice(self, key: str, lazy, get, dim: int, start: int, length: int):
        """A tensor-parallel rank's part read from the file (`lazy`: get_slice): dim 0, output features (qweight's
        and scales' columns, qzeros' words); dim 1, input rows on word and group boundaries, g_idx rebased.
        (qweight, get), or None where the cut falls inside a word or group, or g_idx is not sequential."""
        if not key.endswith(".qweight"):
            return None
        module, end, per = key[:-len(".qweight")], start + length, 32 // self.bits
        scales, zeros, g_idx = get(f"{module}.scales"), get(f"{module}.qzeros"), get(f"{module}.g_idx")
        if scales is None or zeros is None or start % per or length % per:
            return None
        rows = lazy.get_shape()[0] * per
        group = rows if self.group_size == -1 else self.group_size
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // group):
            return None  # act-order: each row's group read from the whole g_idx
        if dim == 0:
            tensor, scales, zeros = lazy[:, start:end], scales[:, start:end], zeros[:, start // per:end // per]
        elif self.group_size == -1 or not (start % group or length % group):
            first = start // group if self.group_size != -1 else 0
            count = -(-length // group) if self.group_size != -1 else 1
            tensor = lazy[start // per:end // per]
            scales, zeros = scales[first:first + count], zeros[first:first + count]
            g_idx = torch.arange(length) // (length if self.group_size == -1 else group)
        else:
            return None
        parts = {f"{module}.scales": scales, f"{module}.qzeros": zeros, f"{module}.g_idx": g_idx}
        return tensor, lambda k: parts[k] if k in parts else get(k)

    def _integers(self, key: str, tensor: torch.Tensor, get):
        """Unsigned values [in, out], true zeros and scales [groups, out], g_idx [in]."""
        module = key[:-len(".qweight")]
        scales, zeros, g_idx = get(f"{module}.scales"), get(f"{module}.qzeros"), get(f"{module}.g_idx")
        if scales is None or zeros is None:
            raise QuantizationError(f"gptq weight {key!r} has no {'scales' if scales is None else 'qzeros'} "
                                    "in the checkpoint")
        values = unpack_rows(tensor, self.bits)  # [in, out]
        rows, cols = values.shape
        if g_idx is None:
            if self.desc_act:
                raise QuantizationError(f"gptq weight {key!r} has desc_act but no g_idx in the checkpoint")
            size = rows if self.group_size == -1 else self.group_size
            g_idx = torch.arange(rows) // size
        if g_idx.numel() != rows or int(g_idx.max()) >= scales.shape[0] or scales.shape[1] != cols:
            raise QuantizationError(f"gptq scales {tuple(scales.shape)} or g_idx ({g_idx.numel()}) of {module} do "
                                    f"not fit its {rows}x{cols} weight (truncated or mismatched checkpoint)")
        zero = unpack_columns(zeros, self.bits, cols) + self.zero_offset
        if zero.shape != scales.shape:
            raise QuantizationError(f"gptq qzeros of {module} unpack to {tuple(zero.shape)}, not {tuple(scales.shape)}")
        return values, zero, scales, g_idx
