"""The weight-only products' side of a kept-quantized linear layer: `pack` (the tensors a kernel reads),
`WeightOnlyIntMethod` (them as the layer's parameters, and the product), `attach` (the layer's forward through its
quant method) and `dense` (the unquantized product). Which kernel a layer gets: linear_kernels.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ....platforms.cpu import two_cores
from .int_weight import IntWeight

# torch's CPU weight-only products with the activations rounded to bf16 (the format's "A16") in a float32 model
BF16_ACTIVATIONS = {"cpu_int4_bf16": "cpu_int4", "cpu_int8_bf16": "cpu_int8"}


# pack()'s tensors as a dense layer's parameters (an MoE layer prefixes them with its projection's name)
DENSE_NAMES = {"scale": "weight_scale", "zero": "weight_zero"}


def pack(weight: IntWeight, kernel: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors `kernel` reads, for one weight [N, K] or a stack of experts' [E, N, K]: cpu_int4 torch's CPU
    int4 pack (half a byte a weight) and `scales_and_zeros` [..., groups, N, 2] in `dtype`; cpu_int8 the values
    and one `scale` per row in `dtype`; triton the values (fp8: its e4m3fn bits; int4: two per byte, the even
    column in the low nibble, offset to unsigned), `scale` float32 and `zero` int8 where asymmetric."""
    if kernel == "cpu_int4":
        def int4pack(values: torch.Tensor) -> torch.Tensor:  # one int32 copy of one matrix at a time
            return torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32).add_(8), 1)
        values = weight.values
        scale = weight.scale.transpose(-1, -2).to(torch.float32)  # [..., groups, out]
        zero = -(weight.zero.transpose(-1, -2).to(torch.float32) * scale) if weight.zero is not None \
            else torch.zeros_like(scale)
        return {"qweight": int4pack(values) if values.dim() == 2 else torch.stack([int4pack(v) for v in values]),
                "scales_and_zeros": torch.stack([scale, zero], dim=-1).to(dtype).contiguous()}
    if kernel == "cpu_int8":
        return {"qweight": weight.values.contiguous(), "scale": weight.scale[..., 0].to(dtype).contiguous()}
    values = weight.values.view(torch.uint8) if weight.fp8 else weight.values  # e4m3fn bits, one byte
    if weight.bits == 4:
        unsigned = (values.to(torch.int16) + 8).to(torch.uint8)
        values = unsigned[..., 0::2] | (unsigned[..., 1::2] << 4)
    packed = {"qweight": values.contiguous(), "scale": weight.scale.to(torch.float32).contiguous()}
    if weight.zero is not None:
        packed["zero"] = weight.zero.to(torch.int8).contiguous()
    return packed


class WeightOnlyIntMethod:
    """Holds the quantized weight on the layer (parameters, so memory accounting and .to() see them) and
    multiplies with the chosen kernel; activations stay in the model dtype, except for the *_bf16 kernels,
    whose product takes and returns bf16 (the output goes back to the model dtype)."""

    def __init__(self, layer: nn.Linear, weight: IntWeight, kernel: str, dtype: torch.dtype) -> None:
        model_dtype = dtype
        if kernel in BF16_ACTIVATIONS:
            kernel, dtype = BF16_ACTIVATIONS[kernel], torch.bfloat16
        self.kernel, self.group_size, self.bits, self.act_dtype = kernel, weight.group_size, weight.bits, dtype
        self.fp8 = weight.fp8
        self.halves: dict = {}  # two_cores' cut of the kept tensors
        device = layer.weight.device
        keep = {DENSE_NAMES.get(k, k): t for k, t in pack(weight, kernel, dtype).items()}
        for name, tensor in keep.items():
            layer.register_parameter(name, nn.Parameter(tensor.to(device), requires_grad=False))
        self.names = tuple(keep)
        # The float weight goes: its shape stays (on the meta device) for whoever reads it, its memory does not.
        layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=model_dtype, device="meta"),
                                    requires_grad=False)

    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """`bias=False`: the product alone (a row-parallel layer's partial sum; its bias follows the sum)."""
        bias = layer.bias if bias else None
        if self.kernel in ("cpu_int4", "cpu_int8"):
            rows = x.reshape(-1, x.shape[-1]).to(self.act_dtype)  # no copy when the dtypes agree
            # In a small step the large products run in two halves on both cores (platforms/cpu/two_cores.py).
            if self.kernel == "cpu_int4":
                out = two_cores.product(lambda w, sz: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    rows, w, self.group_size, sz), len(rows), (layer.qweight, layer.scales_and_zeros),
                    self.halves, x.dtype)
            else:
                out = two_cores.product(lambda w, s: torch.ops.aten._weight_int8pack_mm(rows, w, s), len(rows),
                                        (layer.qweight, layer.weight_scale), self.halves, x.dtype)
            out = out.reshape(*x.shape[:-1], -1)
        else:
            from .triton_int_matmul import int_matmul

            return int_matmul(x, layer.qweight, layer.weight_scale, getattr(layer, "weight_zero", None),
                              self.group_size, self.bits == 4, bias, self.fp8)
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


def dense(layer: nn.Linear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """The unquantized product, for callers that dispatch on `quant_method`; `bias=False` as in its apply."""
    return F.linear(x, layer.weight, layer.bias if bias else None)
