"""The quant method of the opt-in kernels `cpu_int8_vnni` and `cpu_int4_vnni` (KUBEINFER_QUANT_KERNEL,
linear_method.py): a weight-only int8 / int4 checkpoint multiplied in llama.cpp's arithmetic (ops.q8_0_linear:
activations quantized per block of 32 as its Q8_0, integer block sums). It changes the checkpoint's numerics
(the format's activations are 16-bit), hence never the default. The weight is packed at load (kernels.c's
layout: one byte, or half a byte, a weight) with its scales and zero points as float32 / int32 per output row
and group; the float weight goes (meta), as linear_method's methods do."""
from __future__ import annotations

import torch
from torch import nn

from . import ops

KERNELS = {"cpu_int8_vnni": 8, "cpu_int4_vnni": 4}


def applies(kernel: str, values: torch.Tensor, scale: torch.Tensor, group_size: int, bits: int, fp8: bool) -> bool:
    """Blocks of 32 inputs, each inside one weight group: inputs a multiple of 32, groups of a multiple of 32
    (or one scale per row)."""
    cols, groups = values.shape[1], scale.shape[1]
    grouped_ok = groups == 1 or (group_size % ops.BLOCK == 0 and -(-cols // group_size) == groups)
    return not fp8 and bits == KERNELS[kernel] and cols % ops.BLOCK == 0 and grouped_ok


class PackedIntMethod:
    """A layer's int weight packed for one native kernel, kept as parameters (memory accounting and .to() see
    them): "qweight", "weight_scale" (float32 per row and group, ops.pack_groups) and the zero points under
    `zero_name`, each as the subclass packs them (`pack`) and multiplies them (`product`, of ops.packed_linear's
    arguments); the float weight goes (meta), as linear_method's methods do."""
    zero_name = ""

    def __init__(self, layer: nn.Linear, weight, kernel: str, dtype: torch.dtype) -> None:
        self.kernel, self.bits = kernel, weight.bits
        self.out_features, cols = weight.values.shape
        self.group_size = cols if weight.scale.shape[1] == 1 else weight.group_size
        zero = weight.zero if weight.zero is not None else torch.zeros_like(weight.scale, dtype=torch.int8)
        qweight, zeros = self.pack(weight.values, zero)
        keep = {"qweight": qweight, "weight_scale": ops.pack_groups(weight.scale, torch.float32),
                self.zero_name: zeros}
        device = layer.weight.device
        for name, tensor in keep.items():
            layer.register_parameter(name, nn.Parameter(tensor.to(device), requires_grad=False))
        layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=dtype, device="meta"), requires_grad=False)

    def pack(self, values: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed weight, packed zero points) from the int values [out, in] and zero points [out, groups]."""
        raise NotImplementedError

    def product(self, x, packed, bits, scale, zeros, group_size, out_features) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """`bias=False`: the product alone (a row-parallel layer's partial sum), as linear_method's."""
        # The layer's tensors straight from its parameter dict: Module.__getattr__ costs ~0.4 us a name, and a
        # decode step makes ~50 products of 4 names each.
        params = layer._parameters
        out = self.product(x, params["qweight"], self.bits, params["weight_scale"], params[self.zero_name],
                           self.group_size, self.out_features)
        if x.dtype is not torch.float32:
            out = out.to(x.dtype)
        added = params["bias"] if bias else None
        return out if added is None else out + added


class NativeIntMethod(PackedIntMethod):
    """llama.cpp's arithmetic (ops.q8_0_linear); the zero points as the packed storage's offset plus the zero."""
    zero_name = "weight_offset"

    def pack(self, values: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        offset = (128 if self.bits == 8 else 8) + zero.to(torch.int32)
        packed = ops.pack_int8(values) if self.bits == 8 else ops.pack_int4(values)
        return packed, ops.pack_groups(offset, torch.int32)

    def product(self, *args) -> torch.Tensor:
        return ops.q8_0_linear(*args)
