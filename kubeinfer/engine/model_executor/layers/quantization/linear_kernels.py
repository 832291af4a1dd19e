"""The weight-only product's kernels (kernel_registry.py), registered in the default's priority order; the
measured choice each encodes is linear_method.py's docstring. A kernel's `install` packs a layer's weight for it
(its quant method's constructor) and attaches the method, whose `apply` is the product; "dequantized" writes the
float weight instead. The engine's kernels.quant_kernel (KUBEINFER_QUANT_KERNEL) forces one: it runs where it
applies, else its stand-ins (a native kernel: its torch twin without the library, then the other width's),
else "dequantized". `NATIVE` and `SIBLING` are read off the registered kernels."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kubeinfer.engine.kernel_config import setting as kernel_setting
from ..deferred_weight import allocated, device_of, stand_in
from ....platforms.cpu.native import a16_method, method, ops
from .int_weight import IntWeight
from .kernel_registry import ChoiceLog, Kernel, KernelRegistry
from .weight_only import BF16_ACTIVATIONS, WeightOnlyIntMethod, attach

WEIGHT_ONLY = KernelRegistry("weight-only")


@dataclass(frozen=True)
class WeightTarget:
    """What a weight-only kernel is chosen for: one weight (an expert's sample for a stack), where it runs, the
    model dtype, and whether the checkpoint quantizes activations too (w8a8.py then quantizes them exactly,
    which a bf16 rounding would undo)."""
    weight: IntWeight
    device: torch.device
    dtype: torch.dtype
    w8a8: bool = False

    def __str__(self) -> str:
        w = self.weight
        kind = "fp8" if w.fp8 else f"int{w.bits} group {w.group_size}{'' if w.zero is None else ' asymmetric'}"
        return f"a {kind} weight {tuple(w.values.shape)} on {self.device.type} ({self.dtype})"


def _cpu_float32(t: WeightTarget) -> bool:
    return t.device.type != "cuda" and t.dtype == torch.float32 and not t.w8a8


class Dequantized(Kernel):
    name, why = "dequantized", "no kept kernel serves this weight here: the float weight"

    def install(self, layer: nn.Linear, weight: IntWeight, dtype: torch.dtype) -> None:
        with torch.no_grad():
            allocated(layer).copy_(weight.dequantize())


class TorchKernel(Kernel):
    """torch's or Triton's product through WeightOnlyIntMethod; `bf16`: the activations rounded to bf16."""

    def __init__(self, name: str, why: str = "") -> None:
        self.name, self.why = name, why

    def preferred(self, t: WeightTarget) -> bool:
        return False  # forced only, unless a subclass says where the measurements chose it

    def applies(self, t: WeightTarget) -> bool:
        w, kernel = t.weight, BF16_ACTIVATIONS.get(self.name, self.name)
        out, cols = w.values.shape[-2:]
        if w.fp8 and kernel != "triton":
            return False
        if kernel == "cpu_int4":
            return w.bits == 4 and w.group_size in (32, 64, 128, 256) and cols % w.group_size == 0 and out % 16 == 0
        if kernel == "cpu_int8":
            return w.bits == 8 and w.zero is None and w.scale.shape[-1] == 1
        return w.group_size & (w.group_size - 1) == 0 or w.scale.shape[-1] == 1  # triton: power-of-two groups

    def forced(self, t: WeightTarget) -> tuple[str, ...]:
        return self.name, "dequantized"

    def install(self, layer: nn.Linear, weight: IntWeight, dtype: torch.dtype) -> None:
        stand_in(layer)  # a deferred float weight: its device and shape, no memory (deferred_weight.py)
        attach(layer, WeightOnlyIntMethod(layer, weight, self.name, dtype))


class Triton(TorchKernel):
    def preferred(self, t: WeightTarget) -> bool:
        return t.device.type == "cuda"  # every weight on CUDA, as measured (int and e4m3 alike)


class Bf16Activations(TorchKernel):
    def preferred(self, t: WeightTarget) -> bool:
        return _cpu_float32(t) and self.applies(t)


class Int4Pack(TorchKernel):
    def preferred(self, t: WeightTarget) -> bool:
        return t.device.type != "cuda" and t.dtype in (torch.bfloat16, torch.float16) and self.applies(t)


class NativeKernel(Kernel):
    """A native CPU kernel (platforms/cpu/native/): `twin` the torch product of the same width where the library
    does not build, `sibling` the other width's native kernel (an int8 lm_head beside int4 layers)."""

    def __init__(self, name: str, twin: str, sibling: str, default: bool, why: str = "") -> None:
        self.name, self.twin, self.sibling, self.default, self.why = name, twin, sibling, default, why
        self.module = a16_method if name in a16_method.KERNELS else method

    def applies(self, t: WeightTarget) -> bool:
        w = t.weight
        return self.module.applies(self.name, w.values, w.scale, w.group_size, w.bits, w.fp8)

    def preferred(self, t: WeightTarget) -> bool:
        return self.default and _cpu_float32(t) and a16_method.fast() and self.applies(t)

    def forced(self, t: WeightTarget) -> tuple[str, ...]:
        if t.w8a8 or t.device.type != "cpu":  # W8A8 layers: their own exact int8 product (w8a8.py)
            return ("dequantized",)
        if not ops.available():  # no compiler: torch's product of the same width (ops warns once)
            return self.twin, "dequantized"
        return self.name, self.sibling, "dequantized"

    def install(self, layer: nn.Linear, weight: IntWeight, dtype: torch.dtype) -> None:
        stand_in(layer)
        native = a16_method.A16Method if self.module is a16_method else method.NativeIntMethod
        attach(layer, native(layer, weight, self.name, dtype))


_A16 = "the exact A16 product (bf16-rounded activations, float32 sums), the float32 default where it builds"
_BF16 = "torch's weight-only product with bf16 activations, the float32 default without the native A16 product"
for _kernel in (
        Triton("triton", "the dequantize-and-multiply Triton kernel, CUDA's default"),
        NativeKernel("cpu_int4_a16", "cpu_int4_bf16", "cpu_int8_a16", True, _A16),
        NativeKernel("cpu_int8_a16", "cpu_int8_bf16", "cpu_int4_a16", True, _A16),
        Bf16Activations("cpu_int4_bf16", _BF16), Bf16Activations("cpu_int8_bf16", _BF16),
        Int4Pack("cpu_int4", "torch's int4 pack product, the bf16/fp16 default"), TorchKernel("cpu_int8"),
        NativeKernel("cpu_int8_vnni", "cpu_int8_bf16", "cpu_int4_vnni", False),
        NativeKernel("cpu_int4_vnni", "cpu_int4_bf16", "cpu_int8_vnni", False),
        Dequantized()):
    WEIGHT_ONLY.register(_kernel)

KERNELS = WEIGHT_ONLY.names()  # the priority order; KUBEINFER_QUANT_KERNEL accepts these (envs.QUANT_KERNELS)
# CPU only, the native kernels -> their torch twin without a C compiler (a warning once), and the other width's
NATIVE = {k.name: k.twin for k in map(WEIGHT_ONLY.get, KERNELS) if isinstance(k, NativeKernel)}
SIBLING = {k.name: k.sibling for k in map(WEIGHT_ONLY.get, KERNELS) if isinstance(k, NativeKernel)}


def keeps_quantized(device: torch.device, dtype: torch.dtype, fp8: bool = False) -> bool:
    """Whether the loader hands over integer (`fp8`: e4m3) weights (else dequantizes them as it reads): fp8 on CUDA
    only, or where a forced triton kernel (kernels.quant_kernel) takes them."""
    forced = kernel_setting("quant_kernel")
    if forced:
        return forced == "triton" if fp8 else forced != "dequantized"
    return device.type == "cuda" if fp8 else device.type in ("cuda", "cpu")


def choose_kernel(weight: IntWeight, device: torch.device, dtype: torch.dtype, w8a8: bool = False) -> str:
    """The registry's choice for one weight (module docstring), forced by the engine's kernels.quant_kernel."""
    return WEIGHT_ONLY.choose(WeightTarget(weight, device, dtype, w8a8), kernel_setting("quant_kernel")).name


def applies(kernel: str, w: IntWeight) -> bool:
    """Whether `kernel` can multiply `w` (wherever it runs)."""
    return WEIGHT_ONLY.get(kernel).applies(WeightTarget(w, torch.device("cpu"), torch.float32))


def install(model: nn.Module, weights: dict[str, IntWeight], dtype: torch.dtype, w8a8: bool = False,
            log: ChoiceLog | None = None) -> dict[str, str]:
    """Each `<module>.weight` of `weights` kept quantized where its kernel applies, else dequantized into the
    float weight; returns {module: kernel}. `w8a8`: as in WeightTarget; `log`: the start-up log of the choices."""
    chosen, forced = {}, kernel_setting("quant_kernel")
    for name, weight in weights.items():
        module = name.removesuffix(".weight")
        layer = model.get_submodule(module)
        choice = WEIGHT_ONLY.choose(WeightTarget(weight, device_of(layer), dtype, w8a8), forced)
        choice.kernel.install(layer, weight, dtype)
        if log is not None:
            log.note(module, choice, WEIGHT_ONLY.product)
        # the start-up log names fp8 layers apart: "triton_fp8"
        kernel = choice.name
        chosen[module] = f"{kernel}_fp8" if weight.fp8 and kernel != "dequantized" else kernel
    return chosen
