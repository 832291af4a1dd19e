"""MoE experts kept quantized in memory: each expert's int8/int4 (or fp8 e4m3) checkpoint weight, as the format
decodes it to integers and scales (its `int_weight`: linear_method.IntWeight), cut to this tensor-parallel
rank's slice (IntWeight.narrow: gate/up by output rows, down by input columns, a cut inside a group regrouped
exactly) and stacked over the experts for the kernel that multiplies them:

- CUDA (and KUBEINFER_QUANT_KERNEL=triton under TRITON_INTERPRET=1): the fused MoE Triton kernel
  (triton_moe.py) reads values [E, N, K] (int8; fp8 as its e4m3 bits; int4 two per byte [E, N, K / 2], the
  even column in the low nibble, offset to unsigned), scales [E, N, groups] float32 and zeros [E, N, groups]
  int8 (asymmetric) and dequantizes each tile inside the kernel, as triton_int_matmul.py does for a dense layer.
- CPU: the dense layers' kernel choice (linear_method.choose_kernel) applied per active expert: each expert's
  rows of the step go through its own product (grouped.py's loop). For a float32 model:
  - where the native library has an A16 vector path (a16_method.fast(): AVX-512 BF16 or AVX2), the exact A16 product
    (`cpu_int4_a16` / `cpu_int8_a16`, a16_experts.py): int4 (groups of a multiple of 32, or per channel) and
    int8 (per channel or grouped, symmetric or not: kept now, dequantized before), each expert packed at load
    in a16_linear.c's layout (half a byte / one byte a weight, float32 scales and the zero points per 16 rows
    and group) and multiplied by ki_a16_linear, the dense layers' entry point: the activations rounded to bf16
    as torch rounds them, nothing else rounded, float32 sums in one fixed order (batch-invariant);
  - elsewhere torch's weight-only products (`cpu_int8_bf16` / `cpu_int4_bf16`: activations, dequantized
    weights and outputs rounded to bf16): int8 per channel symmetric, [E, N, K] int8 and a bf16 scale a row;
    int4 groups of 32-256, torch's CPU int4 pack per expert [E, N, K / 2] uint8, bf16 scales and zeros.
  Measured (benchmarks/bench_moe_kept.py, RESULTS.md "moe-quantized-kept"; 32 experts, hidden 1024, expert
  intermediate 512, top 4, one thread, a shared 2-core CPU at load ~3), ms at 1 / 16 tokens: float32 stacks
  1.67 / 23.9; torch's int8 0.64 / 5.0, int4 0.37 / 3.2; A16 int8 0.36 / 2.7, int4 0.24 / 1.9 (1.5-1.9x
  torch's). The loop around the products (sorting, gathering, activation, weighted sum) is ~45 us at one token
  and ~0.2 ms at 16; each A16 call ~2.4 us of call overhead (ctypes and the wrapper), too little (<10% of the
  layer) for a batched C entry. Dequantizing only the step's active experts to float32 and multiplying was
  slower than the float32 stacks in every run (22 / 185-189 ms in the first measurement; --dequantized-per-step).
  W4A8 and W8A8 int8 experts (int4 / int8 per channel, symmetric, with int8 dynamic per-token inputs) take the
  dense layers' exact integer kernels instead (`w4a8_vnni` / `int8_vnni` and their torch._int_mm twins,
  a8_experts.py), which quantize each expert's rows as the reference does.
  Layouts no kept product takes (fp8 on a CPU; without the A16 build, asymmetric or grouped int8) and the other
  W8A8 checkpoints' experts (their activations are quantized exactly, which a bf16 rounding would undo) are
  dequantized at load into the float stacks, as the dense layers are; so is everything under
  KUBEINFER_QUANT_KERNEL=dequantized. KUBEINFER_QUANT_KERNEL forces the experts' kernel as the dense layers'
  (a kernel that does not take the layout: dequantized); llama.cpp's arithmetic (`cpu_int*_vnni`) serves dense
  layers only: experts take torch's product of its width.

`--quantization fp8` on a float checkpoint keeps its experts here too, where the kernel exists (CUDA): each
expert quantized per output row to e4m3 as the loader reads it (fp8.Fp8Config.int_weight), values [E, N, K]
one byte a weight and one float32 scale per expert and row, the activations quantized per token
(expert_input_quant.py) as the round trip on a CPU quantizes them.

The float stacks `gate_up_proj` / `down_proj` stay as shapes on the meta device: the kept bytes are what
the parameters hold, so the start-up log's weight bytes (core/model_setup.py memory_summary) are the kept ones.
"""
from __future__ import annotations

import torch
from torch import nn

from ..quantization.activations import ActivationScheme
from ..quantization.linear_method import BF16_ACTIVATIONS, NATIVE, IntWeight, applies, choose_kernel, pack
from . import a8_experts
from .a16_experts import KERNELS as A16_KERNELS
from .a16_experts import A16Experts

PROJECTIONS = ("gate_up", "down")


def choose_expert_kernel(sample: IntWeight, device: torch.device, dtype: torch.dtype, w8a8: bool,
                         inputs: ActivationScheme | None = None) -> str:
    """The dense layers' measured choice for one expert's weight; "dequantized" where no kept kernel serves it.
    `inputs`: the experts' input activation scheme (a W8A8 checkpoint's): int8 dynamic per token takes the exact
    integer products (a8_experts.py) where they apply."""
    exact = a8_experts.choose(sample, inputs, device, dtype) if w8a8 else None
    if exact is not None:
        return exact
    kernel = choose_kernel(sample, device, dtype, w8a8)
    if kernel in NATIVE and kernel not in A16_KERNELS:  # llama.cpp's arithmetic serves dense layers only: torch's
        kernel = NATIVE[kernel] if applies(NATIVE[kernel], sample) else "dequantized"  # of the same width
    if kernel == "triton" and sample.values.shape[1] % 2 and sample.bits == 4:
        return "dequantized"  # int4 is packed two columns a byte
    return kernel


def stack(parts: list[IntWeight]) -> IntWeight:
    """Every expert's weight of one projection, [E, N, K] values with [E, N, groups] scales and zeros."""
    first = parts[0]
    if any(p.group_size != first.group_size or p.bits != first.bits or p.fp8 != first.fp8
           or p.values.shape != first.values.shape or (p.zero is None) != (first.zero is None) for p in parts):
        raise ValueError("the experts of one layer are quantized differently (bits, groups, zero points)")
    values = torch.stack([p.values.view(torch.uint8) if p.fp8 else p.values for p in parts]).view(first.values.dtype)
    zero = None if first.zero is None else torch.stack([p.zero for p in parts])
    return IntWeight(values, torch.stack([p.scale for p in parts]), zero, first.group_size, first.bits, first.fp8)


class ExpertsIntMethod:
    """Holds one MoE layer's kept expert weights on the FusedMoE (parameters `gate_up_qweight`, `down_scale`, ...)
    and multiplies through the chosen kernel."""

    def __init__(self, moe: nn.Module, weights: dict[str, IntWeight], kernel: str, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        self.act_dtype = dtype
        self.a16 = self.a8 = None
        if kernel in A16_KERNELS or kernel in a8_experts.KERNELS:
            device = moe.gate_up_proj.device if device is None else device
            self.kernel = kernel
            if kernel in A16_KERNELS:
                self.a16 = A16Experts(moe, weights, device)
            else:
                self.a8 = a8_experts.A8Experts(moe, weights, kernel, device)
            _drop_float_stacks(moe)
            return
        if kernel in BF16_ACTIVATIONS:
            kernel, self.act_dtype = BF16_ACTIVATIONS[kernel], torch.bfloat16
        self.kernel = kernel
        gate_up = weights["gate_up"]
        self.group_size, self.bits, self.fp8 = gate_up.group_size, gate_up.bits, gate_up.fp8
        self.down_group = weights["down"].group_size  # a TP cut inside a group regroups down alone
        device = moe.gate_up_proj.device if device is None else device
        for which in PROJECTIONS:
            for suffix, tensor in pack(weights[which], kernel, self.act_dtype).items():
                moe.register_parameter(f"{which}_{suffix}", nn.Parameter(tensor.to(device), requires_grad=False))
        _drop_float_stacks(moe)

    def apply(self, moe: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        if self.kernel == "triton":
            from .triton_moe import QuantizedExperts, fused_experts

            quant = {which: QuantizedExperts(getattr(moe, f"{which}_qweight"), getattr(moe, f"{which}_scale"),
                                             getattr(moe, f"{which}_zero", None),
                                             self.group_size if which == "gate_up" else self.down_group,
                                             self.bits == 4, self.fp8) for which in PROJECTIONS}
            return fused_experts(x, moe.gate_up_proj, moe.down_proj, topk_weights, topk_ids,
                                 gate_up_bias=moe.gate_up_proj_bias, down_bias=moe.down_proj_bias,
                                 swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha,
                                 input_quant=moe.input_quant, quantized=quant)
        from .grouped import grouped_experts

        input_quant = None if self.a8 is not None else moe.input_quant  # a8's products quantize their rows
        return grouped_experts(x, moe.gate_up_proj, moe.down_proj, topk_weights, topk_ids, moe.activation,
                               moe.gate_up_proj_bias, moe.down_proj_bias, input_quant,
                               products=lambda which, e, rows, out, bias: self.product(moe, which, e, rows, out, bias))

    def product(self, moe: nn.Module, which: str, expert: int, rows: torch.Tensor, out: torch.Tensor,
                bias: torch.Tensor | None) -> None:
        """out = rows @ W[expert].T (+ bias) for `which` (gate_up or down), through the A16 product or torch's
        weight-only product."""
        if self.a16 is not None:
            return self.a16.product(moe, which, expert, rows, out, bias)
        if self.a8 is not None:
            return self.a8.product(moe, which, expert, rows, out, bias)
        a = rows.to(self.act_dtype)
        qweight = getattr(moe, f"{which}_qweight")[expert]
        if self.kernel == "cpu_int4":
            group = self.group_size if which == "gate_up" else self.down_group
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(a, qweight, group,
                                                           getattr(moe, f"{which}_scales_and_zeros")[expert])
        else:
            y = torch.ops.aten._weight_int8pack_mm(a, qweight, getattr(moe, f"{which}_scale")[expert])
        out.copy_(y)
        if bias is not None:
            out.add_(bias)



def _drop_float_stacks(moe: nn.Module) -> None:
    """The float stacks keep their shapes (on the meta device), not their memory."""
    for which in PROJECTIONS:
        float_stack = getattr(moe, f"{which}_proj")
        setattr(moe, f"{which}_proj", nn.Parameter(torch.empty(float_stack.shape, dtype=float_stack.dtype,
                                                               device="meta"), requires_grad=False))
