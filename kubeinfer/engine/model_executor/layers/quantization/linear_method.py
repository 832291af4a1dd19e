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
  platforms/cpu/native/a16_method.py, a16_linear.c): the activations rounded to bf16 as torch rounds them,
  nothing else rounded, float32 sums in one fixed order (batch-invariant); W4A16 1.40x / 1.26x llama.cpp Q4_0 at
  batch 1 / 16, W8A16 1.61x / 1.97x Q8_0 (whole engine; decoder layers run natively: platforms/cpu/native_decode.py).
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
  AVX-512 VNNI kernels (platforms/cpu/native/): activations quantized per block of 32 as its Q8_0, integer block sums;
  int8 or int4 weights by channel or groups of a multiple of 32, symmetric or not; whole decoder layers natively
  in decode steps. Faster still (benchmarks/RESULTS.md "cpu-native-vnni", "cpu-a16-native"), but it changes a
  weight-only checkpoint's numerics (its activations are 16-bit), so it is never the default.
The kernels are registered in this order of priority in linear_kernels.py (kernel_registry.py: applies, preferred,
forced stand-ins, install), and the choice is logged once per method and layer kind at start. The engine's
kernels.quant_kernel, which KUBEINFER_QUANT_KERNEL fills (triton, cpu_int4, cpu_int8, cpu_int4_bf16, cpu_int8_bf16,
cpu_int4_a16, cpu_int8_a16, cpu_int8_vnni, cpu_int4_vnni, dequantized), overrides the choice where the kernel
applies (a native one names its arithmetic: an int8 lm_head beside int4 layers takes its int8 kernel);
cpu_int4/cpu_int8 take the activations in the model dtype (float32 included).

This module is the per-layer side's facade: IntWeight (int_weight.py), the packing and quant method of torch's and
Triton's products (weight_only.py) and the kernels' registry (linear_kernels.py)."""
from __future__ import annotations

from .int_weight import IntWeight
from .linear_kernels import KERNELS, NATIVE, SIBLING, WEIGHT_ONLY, applies, choose_kernel, install, keeps_quantized
from .weight_only import BF16_ACTIVATIONS, DENSE_NAMES, WeightOnlyIntMethod, attach, dense, pack

__all__ = ["BF16_ACTIVATIONS", "DENSE_NAMES", "KERNELS", "NATIVE", "SIBLING", "WEIGHT_ONLY", "IntWeight",
           "WeightOnlyIntMethod", "applies", "attach", "choose_kernel", "dense", "install", "keeps_quantized", "pack"]
