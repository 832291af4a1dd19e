"""Per-layer quant methods: how a linear layer whose checkpoint weight is int8/int4 multiplies, the weight
kept quantized in memory. `attach(layer, method)` sets `layer.quant_method` and makes the layer's forward
`layer.quant_method.apply(layer, x)`, except where the layer class `calls_quant_method` itself (a row-parallel
layer: `apply(layer, x, bias=False)` is its partial sum, the all-reduce and the bias after it). Under tensor
parallelism each rank holds its slice (IntWeight.narrow, model_executor/int_weights.py). LoRA deltas are
computed beside the base product from the same input (models/llama.py `_project`), so an adapter stays in
float over a quantized base.

Which kernel, chosen by measurement (`python benchmarks/bench_quantized_decode.py --kernels`, one
[tokens, 2048] x [8192, 2048] product; benchmarks/RESULTS.md; three runs on a loaded 2-core CPU):
- CUDA: the Triton dequantize-and-multiply kernel (triton_int_matmul.py), int8 one byte and int4 half a byte
  per weight.
- CPU, float32 model (the CPU default): dequantized float32 weights. With float32 activations torch's
  weight-only products took 3.5-6.5x (int8) and 6-14x (int4) F.linear's time at 1 and 16 tokens, and the
  engine's small float32 steps run through OpenBLAS besides.
- CPU, bf16/fp16 model: int4 (groups of 32-256) through `_weight_int4pack_mm_for_cpu`: from 0.76x to 1.44x
  bf16 F.linear's time at one token (runs disagree), 0.99-1.07x at 16, a quarter of the memory. int8 through
  `_weight_int8pack_mm` was 0.29-1.0x at one token but 1.6-1.9x at 16: int8 weights are dequantized to bf16.
KUBEINFER_QUANT_KERNEL (triton, cpu_int4, cpu_int8, dequantized) overrides the choice where the kernel applies."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("triton", "cpu_int4", "cpu_int8", "dequantized")


@dataclass
class IntWeight:
    """A checkpoint's integer weight: values (signed, int8 storage) [out, in], scale [out, groups] (float32)
    and zero [out, groups] (signed, int8; None when symmetric), groups of `group_size` input columns."""
    values: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int
    bits: int

    @staticmethod
    def cat(parts: list[IntWeight]) -> IntWeight:
        """Fused projections (q/k/v, gate/up): the parts stacked along the output rows."""
        first = parts[0]
        if any(p.group_size != first.group_size or p.bits != first.bits for p in parts):
            raise ValueError("fused projections quantized with different groups or bits")
        zeros = None if all(p.zero is None for p in parts) else torch.cat(
            [p.zero if p.zero is not None else torch.zeros_like(p.scale, dtype=torch.int8) for p in parts])
        return IntWeight(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]), zeros,
                         first.group_size, first.bits)

    def narrow(self, dim: int, start: int, length: int) -> IntWeight:
        """A tensor-parallel rank's slice, copied (the whole tensor is not kept): dim 0 cuts output rows
        (column-parallel layers) with their scales and zeros; dim 1 cuts input columns (row-parallel layers).
        A column slice that does not fall on group boundaries is regrouped exactly: its groups become
        gcd(group_size, start, length) columns, each inside one checkpoint group, with that group's scale
        and zero (more scale columns, the same weight)."""
        if dim == 0:
            cut = lambda t: None if t is None else _copy(t.narrow(0, start, length))
            return IntWeight(cut(self.values), cut(self.scale), cut(self.zero), self.group_size, self.bits)
        cols, size = self.values.shape[1], self.group_size
        aligned = start % size == 0 and (length % size == 0 or start + length == cols)
        group = size if aligned else math.gcd(size, start, length)
        index = (start + torch.arange(0, length, group)) // size  # the checkpoint group of each local group
        pick = lambda t: None if t is None else _copy(t.index_select(1, index.to(t.device)))
        return IntWeight(_copy(self.values.narrow(1, start, length)), pick(self.scale), pick(self.zero), group,
                         self.bits)

    def expand(self, grid: torch.Tensor) -> torch.Tensor:
        return grid.to(torch.float32).repeat_interleave(self.group_size, dim=1)[:, :self.values.shape[1]]

    def dequantize(self) -> torch.Tensor:
        w = self.values.to(torch.float32)
        if self.zero is not None:
            w = w - self.expand(self.zero)
        return w * self.expand(self.scale)


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def keeps_quantized(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the loader should hand over integer weights at all (else it dequantizes as it reads)."""
    forced = os.environ.get("KUBEINFER_QUANT_KERNEL")
    if forced:
        return forced != "dequantized"
    return device.type == "cuda" or dtype in (torch.bfloat16, torch.float16)


def choose_kernel(weight: IntWeight, device: torch.device, dtype: torch.dtype) -> str:
    """The measured choice (module docstring); KUBEINFER_QUANT_KERNEL forces one where it applies."""
    forced = os.environ.get("KUBEINFER_QUANT_KERNEL")
    if forced:
        if forced not in KERNELS:
            raise ValueError(f"KUBEINFER_QUANT_KERNEL must be one of {', '.join(KERNELS)}; got {forced!r}")
        return forced if applies(forced, weight) else "dequantized"
    if device.type == "cuda":
        return "triton"
    if dtype in (torch.bfloat16, torch.float16) and applies("cpu_int4", weight):
        return "cpu_int4"
    return "dequantized"


def applies(kernel: str, w: IntWeight) -> bool:
    out, cols = w.values.shape
    if kernel == "cpu_int4":
        return w.bits == 4 and w.group_size in (32, 64, 128, 256) and cols % w.group_size == 0 and out % 16 == 0
    if kernel == "cpu_int8":
        return w.bits == 8 and w.zero is None and w.scale.shape[1] == 1
    if kernel == "triton":
        return w.group_size & (w.group_size - 1) == 0 or w.scale.shape[1] == 1  # power-of-two groups, or channel
    return True


class WeightOnlyIntMethod:
    """Holds the quantized weight on the layer (parameters, so memory accounting and .to() see them) and
    multiplies with the chosen kernel; activations stay in the model dtype."""

    def __init__(self, layer: nn.Linear, weight: IntWeight, kernel: str, dtype: torch.dtype) -> None:
        self.kernel, self.group_size, self.bits = kernel, weight.group_size, weight.bits
        device = layer.weight.device
        keep = {}
        if kernel == "cpu_int4":
            unsigned = (weight.values.to(torch.int32) + 8).to(device)
            scale = weight.scale.t().to(torch.float32)  # [groups, out]
            zero = -(weight.zero.t().to(torch.float32) * scale) if weight.zero is not None else torch.zeros_like(scale)
            keep["qweight"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1)
            keep["scales_and_zeros"] = torch.stack([scale, zero], dim=-1).to(dtype).contiguous()
        elif kernel == "cpu_int8":
            keep["qweight"] = weight.values.contiguous()
            keep["weight_scale"] = weight.scale[:, 0].to(dtype)
        else:  # triton
            values = weight.values
            if weight.bits == 4:  # two per byte: the even column in the low nibble, offset to unsigned
                unsigned = (values.to(torch.int16) + 8).to(torch.uint8)
                values = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
            keep["qweight"] = values.contiguous()
            keep["weight_scale"] = weight.scale.to(torch.float32).contiguous()
            if weight.zero is not None:
                keep["weight_zero"] = weight.zero.to(torch.int8).contiguous()
        for name, tensor in keep.items():
            layer.register_parameter(name, nn.Parameter(tensor.to(device), requires_grad=False))
        self.names = tuple(keep)
        # The float weight goes: its shape stays (on the meta device) for whoever reads it, its memory does not.
        layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=dtype, device="meta"), requires_grad=False)

    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """`bias=False`: the product alone (a row-parallel layer's partial sum; its bias follows the sum)."""
        bias = layer.bias if bias else None
        if self.kernel == "cpu_int4":
            shape = x.shape
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]), layer.qweight, self.group_size,
                                                             layer.scales_and_zeros).reshape(*shape[:-1], -1)
        elif self.kernel == "cpu_int8":
            shape = x.shape
            out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]), layer.qweight,
                                                     layer.weight_scale).reshape(*shape[:-1], -1)
        else:
            from .triton_int_matmul import int_matmul

            return int_matmul(x, layer.qweight, layer.weight_scale, getattr(layer, "weight_zero", None),
                              self.group_size, self.bits == 4, bias)
        return out if bias is None else out + bias


_QUANTIZED_CLASSES: dict[type, type] = {}


def _quantized_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.quant_method.apply(self, x)


def attach(layer: nn.Linear, method) -> None:
    """Makes `layer` multiply through `method`: its class becomes a subclass whose forward is the method's,
    unless the class says it `calls_quant_method` in a forward of its own (RowParallelLinear: the local
    product, then the collective)."""
    base = type(layer)
    if base not in _QUANTIZED_CLASSES:
        body = {} if getattr(base, "calls_quant_method", False) else {"forward": _quantized_forward}
        _QUANTIZED_CLASSES[base] = type(f"Quantized{base.__name__}", (base,), body)
    layer.quant_method = method
    layer.__class__ = _QUANTIZED_CLASSES[base]


def install(model: nn.Module, weights: dict[str, IntWeight], dtype: torch.dtype) -> dict[str, str]:
    """Each `<module>.weight` of `weights` kept quantized where its kernel applies, else dequantized into the
    float weight; returns {module: kernel}."""
    chosen = {}
    for name, weight in weights.items():
        layer = model.get_submodule(name.removesuffix(".weight"))
        kernel = choose_kernel(weight, layer.weight.device, dtype)
        if kernel == "dequantized":
            with torch.no_grad():
                layer.weight.copy_(weight.dequantize())
        else:
            attach(layer, WeightOnlyIntMethod(layer, weight, kernel, dtype))
        chosen[name.removesuffix(".weight")] = kernel
    return chosen


def dense(layer: nn.Linear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """The unquantized product, for callers that dispatch on `getattr(layer, "quant_method", None)`;
    `bias=False` as in IntLinearMethod.apply."""
    return F.linear(x, layer.weight, layer.bias if bias else None)
