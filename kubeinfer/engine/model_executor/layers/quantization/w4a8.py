"""W4A8 layers (llm-compressor's W4A8 scheme: compressed-tensors `pack-quantized` int4 weights, symmetric, by group
or channel, with int8 dynamic per-token symmetric `input_activations`), multiplied in exact integer arithmetic on
a float32 CPU model, the int4 weight kept packed (half a byte a weight).

The reference (the compressed-tensors forward wrapper that transformers runs) fake-quantizes each input per token,
dequantizes the weight (q * scale, float32) and runs the float product. Here the same int8 activations
(activations.py's quantization, bit for bit; in C by ki_quantize_token_int8 where it builds) and the int4 values
give exact int32 sums per weight group, and out = sum over the groups, in order, of fl(isum_g * fl(x_scale *
w_scale_g)) in float32 (platforms/cpu/native/w4a8_linear.c; w4a8_ops.int_mm_product computes the same bits through
torch._int_mm). It differs from the reference by float rounding only (the reference rounds each product and sum
of its float32 GEMM), and a token's output does not depend on its batch.

Which layers: the loader holds each int4 weight of such a checkpoint that the kernel could take (`hold`: a
float32 CPU model, symmetric int4, groups of a multiple of 32 or per channel, KUBEINFER_QUANT_KERNEL unset or a
native CPU kernel, KUBEINFER_W8A8_KERNEL not fake_quant); w8a8.install then gives a held layer whose input is
int8 dynamic per token, symmetric, this product (`take`: w4a8_vnni, the native kernel; w4a8_int_mm with
KUBEINFER_W8A8_KERNEL=int_mm or without the native library) and dequantizes every other held weight into the
float weight (`take` / `release`): those run as before, fake quantization over the dequantized weight (static or
asymmetric activation scales, weight-only config groups beside the W4A8 ones), which is the reference's own
computation. Tensor parallelism: each rank holds its slice of the integers (int_weights.py; a column cut inside
a weight group regroups it, IntWeight.narrow) and a row-parallel rank quantizes its slice with the whole token's
range (w8a8_tp.range_reducer). LoRA: the adapter reads the unquantized input beside this product (w8a8.py).
Decode steps run whole decoder layers natively with it (platforms/cpu/native_decode.py, the same bits).

Speed (benchmarks/RESULTS.md "quantized-decode-w4a8", the 222M `large` model, 2 cores, load 0.9-1.0, 5
interleaved rounds, best / median): 281.3 / 228.0 tok/s at batch 1 and 1317 / 1182 at 16, against 22.2 / 22.1 and
128 / 118 before (the dequantized float32 weight and fake-quantized input), 257.5 / 200.7 and 967 / 927 for the
W4A16 checkpoint (the exact A16 product), 247.2 / 241.8 and 938 / 856 for llama.cpp Q4_0 (1.14x / 1.40x best)."""
from __future__ import annotations

import logging

import torch
from torch import nn

from kubeinfer.engine.kernel_config import setting as kernel_setting
from ..deferred_weight import allocated, device_of
from ..vocab_parallel import ParallelLMHead
from .activations import ActivationScheme
from ....platforms.cpu.native import w4a8_ops
from .linear_method import NATIVE, IntWeight
from .w8a8_tp import range_reducer

KERNELS = ("w4a8_vnni", "w4a8_int_mm")
logger = logging.getLogger(__name__)
_SAID: set = set()  # the schemes whose fallback was logged
_HELD = "_w4a8_held"  # the held IntWeight, an attribute of its layer until w8a8.install takes or dequantizes it


def holds(weight: IntWeight, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the loader keeps this weight for the W4A8 product (module docstring), before the activation scheme
    of its layer is read."""
    forced = kernel_setting("quant_kernel")
    cols, groups = weight.values.shape[1], weight.scale.shape[1]
    return (weight.bits == 4 and not weight.fp8 and weight.zero is None and weight.values.dim() == 2
            and device.type == "cpu" and dtype == torch.float32 and (not forced or forced in NATIVE)
            and w4a8_ops.takes(cols, groups, weight.group_size))


def hold(model: nn.Module, weights: dict[str, IntWeight], dtype: torch.dtype) -> dict[str, IntWeight]:
    """Each `<module>.weight` of `weights` the W4A8 product could take held on its layer (its float weight left
    unwritten); returns the others, for linear_method.install (a quantized lm_head among them: its vocabulary-
    parallel forward and native logits path know linear_method's and W8A8's methods only)."""
    rest = {}
    for name, weight in weights.items():
        layer = model.get_submodule(name.removesuffix(".weight"))
        head = isinstance(layer, ParallelLMHead) or name == "lm_head.weight"  # a quantized head: as before
        if isinstance(layer, nn.Linear) and not head and holds(weight, device_of(layer), dtype):
            setattr(layer, _HELD, weight)
        else:
            rest[name] = weight
    return rest


def take(layer: nn.Linear, scheme: ActivationScheme, kernel: str | None):
    """A held layer's W4A8Method when `kernel` (one of KERNELS, chosen by w8a8.py) applies to `scheme`, else
    None after dequantizing the held weight into the layer (the fake-quantized product runs, as the reference);
    None for a layer not held."""
    weight = layer.__dict__.pop(_HELD, None)
    if weight is None:
        return None
    if kernel in KERNELS and scheme.type == "int" and scheme.strategy == "token" and scheme.dynamic \
            and scheme.symmetric:
        return W4A8Method(layer, scheme, weight, kernel)
    if scheme is not None and scheme not in _SAID:  # once per scheme in a process, not once a layer
        _SAID.add(scheme)
        logger.info("int4 weights with %s activations: not the exact W4A8 product (it takes int8 dynamic per-token "
                    "symmetric activations on a float32 CPU model, KUBEINFER_W8A8_KERNEL int8_vnni or int_mm); "
                    "dequantized to float32, inputs fake-quantized as the reference", scheme.describe())
    with torch.no_grad():
        allocated(layer).copy_(weight.dequantize())
    return None


def release(model: nn.Module) -> None:
    """Held weights no activation scheme claimed (a weight-only group beside W4A8 ones): dequantized into their
    float weights, as the other weights of a W8A8 checkpoint are."""
    for layer in model.modules():
        if _HELD in layer.__dict__:
            take(layer, None, None)


class W4A8Method:
    """The int4 weight as parameters (memory accounting and .to() see them): w4a8_vnni `qweight_int4` (packed)
    and `weight_group_scale` [N / 16, groups, 16]; w4a8_int_mm `qweight_t` int8 [K, N] and `weight_group_scale`
    [groups, N]. The float weight goes (meta), as linear_method's methods do."""

    def __init__(self, layer: nn.Linear, scheme: ActivationScheme, weight: IntWeight, kernel: str) -> None:
        self.scheme, self.kernel = scheme, kernel
        self.out_features, cols = weight.values.shape
        self.group_size = cols if weight.scale.shape[1] == 1 else weight.group_size
        self.reduce_range = range_reducer(layer, scheme)  # a row-parallel rank's token range made whole (w8a8_tp)
        if kernel == "w4a8_vnni":
            packed, scale = w4a8_ops.pack(weight.values, weight.scale.to(torch.float32))
            keep = {"qweight_int4": packed, "weight_group_scale": scale}
        else:
            keep = {"qweight_t": weight.values.t().contiguous(),
                    "weight_group_scale": weight.scale.to(torch.float32).t().contiguous()}
        device = device_of(layer)
        for name, tensor in keep.items():
            layer.register_parameter(name, nn.Parameter(tensor.to(device), requires_grad=False))
        layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=layer.weight.dtype, device="meta"),
                                    requires_grad=False)

    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """`bias=False`: the product alone (a row-parallel layer's partial sum; its bias follows the sum)."""
        rows = x.reshape(-1, x.shape[-1])
        params = layer._parameters  # not Module.__getattr__ (~0.4 us a name; ~50 products a decode step)
        if self.kernel == "w4a8_vnni":
            out = w4a8_ops.linear(rows, self.scheme, params["qweight_int4"], params["weight_group_scale"],
                                  self.group_size, self.out_features, self.reduce_range)
        else:
            q, sx = w4a8_ops.quantized_tokens(rows, self.scheme, self.reduce_range)
            out = w4a8_ops.int_mm_product(q, sx, params["qweight_t"], params["weight_group_scale"], self.group_size)
        if x.dtype is not torch.float32:
            out = out.to(x.dtype)
        if x.dim() != 2:
            out = out.view(*x.shape[:-1], -1)
        added = params["bias"] if bias else None
        return out if added is None else out + added
