"""MoE experts of W4A8 and W8A8 int8 checkpoints (int4 or int8 weights, symmetric; int8 dynamic per-token symmetric
input activations: llm-compressor's W4A8 and W8A8 schemes) in exact integer arithmetic on a float32 CPU model,
through the dense layers' kernels and entry points (quantization/w4a8.py, w8a8.py):

- `w4a8_vnni`: int4 by groups of a multiple of 32 or per channel, each expert packed at load in the dense W4A8
  layout (w4a8_ops.pack: half a byte a weight, float32 scales per 16 rows and group); each active expert's rows
  through ki_w4a8_f32 (each row quantized in C, exact int32 sums per group, out = sum over groups of
  fl(isum_g * fl(x_scale * w_scale_g)));
- `int8_vnni`: int8 per channel, each expert packed by ops.pack_int8 (one byte a weight), ki_quantize_token_int8
  then ki_w8a8, as ops.w8a8_linear;
- `w4a8_int_mm` / `int_mm`: their torch._int_mm twins (KUBEINFER_W8A8_KERNEL=int_mm, or no native library; the
  same bits), values [E, K, N] int8.

The activations as the reference quantizes them (each expert's gate_proj / up_proj quantizes its input per token,
its down_proj its intermediate row per token): gate/up's rows are the gathered hidden states, one row per (token,
expert), quantized per row, which is the bits of quantizing the token once; down's rows each (token, expert)
intermediate row. The products quantize, so the layer's ExpertInputQuant (expert_input_quant.py: fake quantization in
float) does not run. Under tensor parallelism a rank's slice of an intermediate row is quantized with the whole
row's range (input_quant's down range, w8a8_tp.whole_token_range: one all-reduce per active expert; every rank
runs the same experts in the same order). A token's output does not depend on its batch.

Chosen (`choose`) as the dense layers choose theirs: a float32 CPU model, KUBEINFER_W8A8_KERNEL int8_vnni (the
default; the int_mm twins without the native library) or int_mm, KUBEINFER_QUANT_KERNEL unset or naming a native
CPU kernel; under KUBEINFER_W8A8_KERNEL=fake_quant or another forced KUBEINFER_QUANT_KERNEL the experts run as
before (int_experts.choose_expert_kernel: on a CPU, dequantized with fake-quantized inputs). The kernel is looked
up at each product (ops.kernel: per loaded library), never held from load."""
from __future__ import annotations


import torch
from torch import nn

from kubeinfer.engine.kernel_config import setting as kernel_setting
from ..quantization import w8a8
from ..quantization.activations import ActivationScheme, int8_linear
from ....platforms.cpu.native import ops, w4a8_ops
from ..quantization.linear_method import NATIVE, IntWeight
from ..quantization.w8a8_kernels import W4A8, W8A8, ExactTarget, w4a8_forced, w8a8_forced
from .a16_experts import register_stacks

KERNELS = ("w4a8_vnni", "w4a8_int_mm", "int8_vnni", "int_mm")
TOKEN = ActivationScheme("int", "token", True, True)  # the only input scheme these products take


def choose(sample: IntWeight, inputs: ActivationScheme | None, device: torch.device, dtype: torch.dtype) -> str | None:
    """The exact integer product for one expert's weight `sample` whose input scheme is `inputs` (module
    docstring), or None: the other kernels' choice."""
    forced = kernel_setting("quant_kernel")
    if (inputs != TOKEN or device.type != "cpu" or dtype != torch.float32 or sample.fp8 or sample.zero is not None
            or sample.values.dim() != 2 or (forced and forced not in NATIVE)):
        return None
    wanted = w8a8.wanted_kernel()
    if wanted == "fake_quant":
        return None
    cols, groups = sample.values.shape[1], sample.scale.shape[-1]  # the dense layers' registries choose
    if sample.bits == 4 and w4a8_ops.takes(cols, groups, sample.group_size):
        return W4A8.choose(ExactTarget("experts", True), w4a8_forced(wanted)).name
    if sample.bits == 8 and groups == 1:
        return W8A8.choose(ExactTarget("experts", True, True, cols), w8a8_forced(wanted)).name
    return None


def pack(weight: IntWeight, kernel: str) -> dict[str, torch.Tensor]:
    """A stack of experts [E, N, K] in `kernel`'s layout: the dense layer's, one expert at a time."""
    scale = weight.scale.to(torch.float32)
    if kernel == "w4a8_vnni":
        packed = [w4a8_ops.pack(v, s) for v, s in zip(weight.values, scale)]
        return {"qweight": torch.stack([p[0] for p in packed]), "scale": torch.stack([p[1] for p in packed])}
    values_t = weight.values.transpose(1, 2).contiguous()  # [E, K, N]
    if kernel == "w4a8_int_mm":
        return {"qweight": values_t, "scale": scale.transpose(1, 2).contiguous()}  # [E, groups, N]
    rows_scale = scale[..., 0].contiguous()  # [E, N]: one scale a row
    if kernel == "int8_vnni":
        return {"qweight": torch.stack([ops.pack_int8(v) for v in weight.values]), "scale": rows_scale}
    return {"qweight": values_t, "scale": rows_scale}


class A8Experts:
    """One MoE layer's experts packed for `kernel` (registered on the layer as parameters `{which}_qweight`,
    `{which}_scale`: memory accounting and .to() see them); `product` is grouped.py's per-expert product."""

    def __init__(self, moe: nn.Module, weights: dict[str, IntWeight], kernel: str, device: torch.device) -> None:
        self.kernel, self.scheme = kernel, TOKEN  # w8a8_experts checks the checkpoint's schemes against it
        self.layout = register_stacks(moe, weights, lambda weight: pack(weight, kernel), device)

    def product(self, moe: nn.Module, which: str, expert: int, rows: torch.Tensor, out: torch.Tensor,
                bias: torch.Tensor | None) -> None:
        """out = quantized(rows) @ W[expert].T (+ bias), float32, written in place: the native kernels straight
        into `out` where it is a contiguous float32 block (a step's rows of one expert are), each expert's
        weight found by its byte offset in the stacks (no view made)."""
        names, sizes, n, k, groups, group = self.layout[which]
        params = moe._parameters  # Module.__getattr__ costs ~0.4 us a name
        reduce_range = None
        if which == "down" and moe.input_quant is not None:
            reduce_range = moe.input_quant.ranges["down"]  # a TP rank's slice of each row: the whole row's range
        if rows.dtype is not torch.float32 or not rows.is_contiguous():
            rows = rows.to(torch.float32).contiguous()
        native = self.kernel in ("w4a8_vnni", "int8_vnni") and reduce_range is None
        direct = native and out.dtype is torch.float32 and out.is_contiguous()
        if native:
            target = out if direct else rows.new_empty(rows.shape[0], n)
            weight, scale = (params[name].data_ptr() + expert * size for name, size in zip(names, sizes))
            if self.kernel == "w4a8_vnni":  # each expert's block `sizes` bytes long (the kernels check against them)
                w4a8_ops.linear_into(rows, weight, sizes[0], scale, sizes[1], groups, group, target)
            else:
                _int8_into(rows, weight, sizes[0], scale, sizes[1], target)
        else:
            target = self._dense_entry_product(params, names, expert, rows, group, n, reduce_range)
        if not direct:
            out.copy_(target)
        if bias is not None:
            out.add_(bias)

    def _dense_entry_product(self, params, names, expert: int, rows: torch.Tensor, group: int, n: int, reduce_range):
        """The dense layers' own entry points on this expert's views: the torch._int_mm twins, and the native
        kernels under tensor parallelism (their Python quantization takes the whole row's range)."""
        weight, scale = (params[name][expert] for name in names)
        if self.kernel == "int8_vnni":
            return ops.w8a8_linear(rows, TOKEN, weight, scale, None, reduce_range)
        if self.kernel == "int_mm":
            return int8_linear(rows, TOKEN, weight, scale, None, reduce_range)
        q, sx = w4a8_ops.quantized_tokens(rows, TOKEN, reduce_range)
        if self.kernel == "w4a8_vnni":
            return w4a8_ops.product(q, sx, weight, scale, group, n)
        return w4a8_ops.int_mm_product(q, sx, weight, scale, group)


def _int8_into(rows: torch.Tensor, weight: int, weight_bytes: int, scale: int, scale_bytes: int,
               out: torch.Tensor) -> None:
    """ops.w8a8_linear's two native calls (the rows quantized per row, then ki_w8a8) into `out` [M, N], the expert's
    packed weight and scales by address and length in bytes."""
    m, k = rows.shape
    if not m:
        return
    q, sx = torch.empty(m, k, dtype=torch.int8), rows.new_empty(m)
    ops.quantize_token_int8(rows, q, sx)
    ops.w8a8_into(q, sx, weight, weight_bytes, scale, scale_bytes, out)
