"""The kernels of W8A8's int8 product and W4A8's int4 x int8 product (kernel_registry.py), in priority order; the
measurements behind the order are w8a8.py's and w4a8.py's docstrings. The engine's kernels.w8a8_kernel
(KUBEINFER_W8A8_KERNEL: int8_vnni, the default, int_mm or fake_quant) forces W8A8's: a kernel that does not
apply to a layer runs its stand-ins (int8_vnni -> int_mm -> fake_quant, the reference's own float product); for
W4A8 int_mm forces w4a8_int_mm and fake_quant takes no int4 layer (w4a8.py then dequantizes them)."""
from __future__ import annotations

from dataclasses import dataclass

from ....platforms.cpu.native import ops as native_ops
from .kernel_registry import Kernel, KernelRegistry

W8A8 = KernelRegistry("w8a8")
W4A8 = KernelRegistry("w4a8")


@dataclass(frozen=True)
class ExactTarget:
    """A layer whose input quantization an exact integer product could take. `exact`: int8 dynamic per-token
    symmetric inputs on a float32 CPU model (w8a8._int_mm_applies); `int8_weight`: its int8 per-channel weight
    recovered exactly (W8A8 only); `inputs`: its input features (the native kernel's int32 sums bound them)."""
    layer: str
    exact: bool
    int8_weight: bool = True
    inputs: int = 0

    def __str__(self) -> str:
        return self.layer


class Int8Vnni(Kernel):
    name, why = "int8_vnni", "the native VNNI int8 product (the same bits as torch._int_mm, faster)"

    def applies(self, t: ExactTarget) -> bool:
        return t.exact and t.int8_weight and t.inputs <= native_ops.MAX_INPUTS and native_ops.available()

    def forced(self, t: ExactTarget) -> tuple[str, ...]:
        return "int8_vnni", "int_mm", "fake_quant"


class IntMm(Kernel):
    name, why = "int_mm", "torch._int_mm's exact int8 product (the native library does not build, or too many inputs)"

    def applies(self, t: ExactTarget) -> bool:
        return t.exact and t.int8_weight

    def forced(self, t: ExactTarget) -> tuple[str, ...]:
        return "int_mm", "fake_quant"


class FakeQuant(Kernel):
    name, why = "fake_quant", "the reference's own computation: the input fake-quantized, the float product"


class W4A8Vnni(Kernel):
    name, why = "w4a8_vnni", "the native int4 x int8 product, the int4 weight kept packed"

    def applies(self, t: ExactTarget) -> bool:
        return t.exact and native_ops.available()


class W4A8IntMm(Kernel):
    name, why = "w4a8_int_mm", "torch._int_mm per weight group (the same bits; without the native library)"

    def applies(self, t: ExactTarget) -> bool:
        return t.exact


for _kernel in (Int8Vnni(), IntMm(), FakeQuant()):
    W8A8.register(_kernel)
for _kernel in (W4A8Vnni(), W4A8IntMm()):
    W4A8.register(_kernel)


def w8a8_forced(w8a8_kernel: str) -> str | None:
    """The W8A8 kernel the setting forces: int8_vnni, the default, is the priority order itself."""
    return None if w8a8_kernel == "int8_vnni" else w8a8_kernel


def w4a8_forced(w8a8_kernel: str) -> str | None:
    """The W4A8 kernel the W8A8 setting forces: int_mm -> w4a8_int_mm; int8_vnni is the default's order."""
    return "w4a8_int_mm" if w8a8_kernel == "int_mm" else None
