"""Per-layer quant methods: how a linear layer whose checkpoint weight is int8/int4 or fp8 (e4m3) multiplies,
the weight kept quantized in memory. `attach(layer, method)` sets `layer.quant_method` and makes the layer's forward
`layer.quant_method.apply(layer, x)`, except where the layer class `calls_quant_method` itself (a row-parallel
layer: `apply(layer, x, bias=False)` is its partial sum, the all-reduce and the bias after it). Under tensor
parallelism each rank holds its slice (IntWeight.narrow, model_executor/int_weights.py). LoRA deltas are
computed beside the base product from the same input (models/llama.py `_project`), so an adapter stays in
float over a quantized base.

Which kernel, chosen by measurement (benchmarks/RESULTS.md "Quantized weights"; a 2-core AVX-512 VNNI CPU
without AMX, shared with other jobs, load 4-6: ratios, not absolute figures):
- CUDA: the Triton dequantize-and-multiply kernel (triton_int_matmul.py), int8 and fp8 one byte and int4 half a
  byte per weight. fp8 weights (IntWeight.fp8: e4m3fn values, their per-tensor, per-channel or block scales
  spread to one per output row and group of `weight_block_size[1]` columns) are kept on CUDA only.
- CPU, fp8: dequantized to the model dtype at load (no fp8 matmul on a CPU; KUBEINFER_QUANT_KERNEL=triton keeps
  them through the kernel under TRITON_INTERPRET=1, for tests).
- CPU, float32 model (the CPU default): int4 (groups of a multiple of 32, or per channel) and int8 (per channel
  or grouped, symmetric or not) kept, through the native exact A16 product (`cpu_int4_a16`, `cpu_int8_a16`;
  platforms/cpu/native/a16_method.py, a16_linear.c): the activations rounded to bf16 as torch rounds them, nothing else
  rounded, float32 sums in one fixed order (batch-invariant); W4A16 1.40x / 1.26x llama.cpp Q4_0 at batch 1 / 16,
  W8A16 1.61x / 1.97x Q8_0 (whole engine; decoder layers run natively: platforms/cpu/native_decode.py).
  Where the library does not build with AVX-512 BF16 (no compiler, another CPU): torch's weight-only products with the activations, the
  dequantized weights and the output rounded to bf16 (`cpu_int4_bf16`, `cpu_int8_bf16`; int4 groups of 32-256,
  int8 per channel symmetric), the only way torch's products are fast here (float32 activations: 30-190x
  slower). Figures: a16_method.py and benchmarks/RESULTS.md "cpu-a16-native". Numerics: log-probabilities
  within 0.25 of transformers' float32 on the decompressed checkpoint (tests/engine/test_quantized_kept.py; measured
  on a tiny random model 0.04-0.06 A16, 0.07-0.13 torch's bf16), and the A16 product's greedy tokens are
  transformers' with bf16-rounded inputs to the quantized layers. Other int layouts, and the weights of
  checkpoints that quantize activations (W8A8: w8a8.py quantizes them exactly, which a bf16 rounding would undo;
  W4A8's int4 stays packed, w4a8.py), are dequantized to float32. torch's products run on one torch thread in
  decode steps and, with KUBEINFER_CPU_SHARE_CORES, in two halves on both cores (platforms/cpu/two_cores.py;
  benchmarks/RESULTS.md "cpu-decode-step"); the native ones on the native pool (platforms/cpu/native/ops.py).
- CPU, bf16/fp16 model: int4 through `_weight_int4pack_mm_for_cpu` (0.76x-1.44x bf16 F.linear's time at one
  token, on a par at 16, a quarter of the memory); int8 dequantized to bf16 (`_weight_int8pack_mm` was
  0.29-1.0x at one token but 1.6-1.9x at 16).
- CPU, opt-in (KUBEINFER_QUANT_KERNEL=cpu_int8_vnni / cpu_int4_vnni): llama.cpp's arithmetic through the native
  AVX-512 VNNI kernels (cpu_native/): activations quantized per block of 32 as its Q8_0, integer block sums;
  int8 or int4 weights by channel or groups of a multiple of 32, symmetric or not; whole decoder layers natively
  in decode steps. Faster still (benchmarks/RESULTS.md "cpu-native-vnni", "cpu-a16-native"), but it changes a
  weight-only checkpoint's numerics (its activations are 16-bit), so it is never the default.
KUBEINFER_QUANT_KERNEL (triton, cpu_int4, cpu_int8, cpu_int4_bf16, cpu_int8_bf16, cpu_int4_a16, cpu_int8_a16,
cpu_int8_vnni, cpu_int4_vnni, dequantized) overrides the choice where the kernel applies (a native one names its
arithmetic: an int8 lm_head beside int4 layers takes its int8 kernel); cpu_int4/cpu_int8 take the activations in
the model dtype (float32 included)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import kubeinfer.engine.envs as envs
from ....platforms.cpu import two_cores
from ..deferred_weight import allocated, device_of, stand_in

KERNELS = envs.QUANT_KERNELS  # declared with the variable that forces them
# CPU only, the native kernels: the exact A16 product (platforms/cpu/native/a16_method.py) and, opt-in, llama.cpp's
# arithmetic
# (platforms/cpu/native/method.py); without a C compiler torch's bf16-activation product of the same width (a warning
# once)
NATIVE = {"cpu_int4_a16": "cpu_int4_bf16", "cpu_int8_a16": "cpu_int8_bf16", "cpu_int8_vnni": "cpu_int8_bf16",
          "cpu_int4_vnni": "cpu_int4_bf16"}
SIBLING = {k: k.replace("int4", "int8") if "int4" in k else k.replace("int8", "int4") for k in NATIVE}  # other width
# torch's CPU weight-only products with the activations rounded to bf16 (the format's "A16") in a float32 model
BF16_ACTIVATIONS = {"cpu_int4_bf16": "cpu_int4", "cpu_int8_bf16": "cpu_int8"}


@dataclass
class IntWeight:
    """A checkpoint's integer weight: values (signed, int8 storage) [out, in], scale [out, groups] (float32)
    and zero [out, groups] (signed, int8; None when symmetric), groups of `group_size` input columns. `fp8`:
    the values are float8_e4m3fn (bits 8, no zero), the weight values * scale."""
    values: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int
    bits: int
    fp8: bool = False

    @staticmethod
    def cat(parts: list[IntWeight]) -> IntWeight:
        """Fused projections (q/k/v, gate/up): the parts stacked along the output rows."""
        first = parts[0]
        if any(p.group_size != first.group_size or p.bits != first.bits or p.fp8 != first.fp8 for p in parts):
            raise ValueError("fused projections quantized with different groups or bits")
        zeros = None if all(p.zero is None for p in parts) else torch.cat(
            [p.zero if p.zero is not None else torch.zeros_like(p.scale, dtype=torch.int8) for p in parts])
        values = torch.cat([p.values.view(torch.uint8) if p.fp8 else p.values for p in parts])
        return IntWeight(values.view(first.values.dtype), torch.cat([p.scale for p in parts]), zeros,
                         first.group_size, first.bits, first.fp8)

    def narrow(self, dim: int, start: int, length: int) -> IntWeight:
        """A tensor-parallel rank's slice, copied (the whole tensor is not kept): dim 0 cuts output rows
        (column-parallel layers) with their scales and zeros; dim 1 cuts input columns (row-parallel layers).
        A column slice that does not fall on group boundaries is regrouped exactly: its groups become
        gcd(group_size, start, length) columns, each inside one checkpoint group, with that group's scale
        and zero (more scale columns, the same weight)."""
        if dim == 0:
            cut = lambda t: None if t is None else _copy(t.narrow(0, start, length))
            return IntWeight(cut(self.values), cut(self.scale), cut(self.zero), self.group_size, self.bits, self.fp8)
        cols, size = self.values.shape[1], self.group_size
        aligned = start % size == 0 and (length % size == 0 or start + length == cols)
        group = size if aligned else math.gcd(size, start, length)
        index = (start + torch.arange(0, length, group)) // size  # the checkpoint group of each local group
        pick = lambda t: None if t is None else _copy(t.index_select(1, index.to(t.device)))
        return IntWeight(_copy(self.values.narrow(1, start, length)), pick(self.scale), pick(self.zero), group,
                         self.bits, self.fp8)

    def expand(self, grid: torch.Tensor) -> torch.Tensor:
        """A [..., N, groups] grid spread to one entry per input column, float32."""
        return grid.to(torch.float32).repeat_interleave(self.group_size, dim=-1)[..., :self.values.shape[-1]]

    def dequantize(self) -> torch.Tensor:
        """float32 [..., N, K]: one weight, or the experts' stack (fused_moe/int_experts.py)."""
        w = self.values.to(torch.float32)
        if self.zero is not None:
            w = w - self.expand(self.zero)
        return w * self.expand(self.scale)


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def keeps_quantized(device: torch.device, dtype: torch.dtype, fp8: bool = False) -> bool:
    """Whether the loader hands over integer (`fp8`: e4m3) weights (else dequantizes them as it reads): fp8 on CUDA
    only, or where KUBEINFER_QUANT_KERNEL=triton forces the kernel."""
    forced = envs.QUANT_KERNEL.get()
    if forced:
        return forced == "triton" if fp8 else forced != "dequantized"
    return device.type == "cuda" if fp8 else device.type in ("cuda", "cpu")


def choose_kernel(weight: IntWeight, device: torch.device, dtype: torch.dtype, w8a8: bool = False) -> str:
    """The measured choice (module docstring); KUBEINFER_QUANT_KERNEL forces one where it applies. `w8a8`: the
    checkpoint quantizes activations too (w8a8.py quantizes them, then multiplies), so no kernel rounds them
    to bf16 on the way."""
    forced = envs.QUANT_KERNEL.get()
    if forced:
        if forced in NATIVE:
            from ....platforms.cpu.native import ops

            if w8a8 or device.type != "cpu":  # W8A8 layers: their own exact int8 product (w8a8.py)
                return "dequantized"
            forced = forced if ops.available() else NATIVE[forced]
        return next((k for k in (forced, SIBLING.get(forced)) if k and applies(k, weight)), "dequantized")
    if device.type == "cuda":
        return "triton"
    if weight.fp8:
        return "dequantized"
    if dtype == torch.float32 and not w8a8:
        from ....platforms.cpu.native import a16_method

        native = ("cpu_int4_a16", "cpu_int8_a16") if a16_method.fast() else ()
        return next((k for k in (*native, "cpu_int4_bf16", "cpu_int8_bf16") if applies(k, weight)), "dequantized")
    if dtype in (torch.bfloat16, torch.float16) and applies("cpu_int4", weight):
        return "cpu_int4"
    return "dequantized"


def applies(kernel: str, w: IntWeight) -> bool:
    kernel = BF16_ACTIVATIONS.get(kernel, kernel)
    out, cols = w.values.shape
    if kernel in NATIVE:
        from ....platforms.cpu.native import a16_method, method

        native = a16_method if kernel in a16_method.KERNELS else method
        return native.applies(kernel, w.values, w.scale, w.group_size, w.bits, w.fp8)
    if w.fp8 and kernel != "triton":
        return kernel == "dequantized"
    if kernel == "cpu_int4":
        return w.bits == 4 and w.group_size in (32, 64, 128, 256) and cols % w.group_size == 0 and out % 16 == 0
    if kernel == "cpu_int8":
        return w.bits == 8 and w.zero is None and w.scale.shape[1] == 1
    if kernel == "triton":
        return w.group_size & (w.group_size - 1) == 0 or w.scale.shape[1] == 1  # power-of-two groups, or channel
    return True


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


def install(model: nn.Module, weights: dict[str, IntWeight], dtype: torch.dtype, w8a8: bool = False) -> dict[str, str]:
    """Each `<module>.weight` of `weights` kept quantized where its kernel applies, else dequantized into the
    float weight; returns {module: kernel}. `w8a8`: as in choose_kernel."""
    chosen = {}
    for name, weight in weights.items():
        layer = model.get_submodule(name.removesuffix(".weight"))
        kernel = choose_kernel(weight, device_of(layer), dtype, w8a8)
        if kernel == "dequantized":
            with torch.no_grad():
                allocated(layer).copy_(weight.dequantize())
        elif kernel in NATIVE:
            from ....platforms.cpu.native import a16_method, method

            stand_in(layer)  # a deferred float weight: its device and shape, no memory (deferred_weight.py)
            native = a16_method.A16Method if kernel in a16_method.KERNELS else method.NativeIntMethod
            attach(layer, native(layer, weight, kernel, dtype))
        else:
            stand_in(layer)
            attach(layer, WeightOnlyIntMethod(layer, weight, kernel, dtype))
        # the start-up log names fp8 layers apart: "triton_fp8"
        chosen[name.removesuffix(".weight")] = f"{kernel}_fp8" if weight.fp8 and kernel != "dequantized" else kernel
    return chosen


def dense(layer: nn.Linear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """The unquantized product, for callers that dispatch on `quant_method`; `bias=False` as in its apply."""
    return F.linear(x, layer.weight, layer.bias if bias else None)
