"""The served quantization methods, one registration each (registry.py), in the order the served list shows
them. A new method: its module (a config class, see registry.QuantizationMethod) and one line here."""
from __future__ import annotations

from .registry import QuantizationMethod, register_method

register_method(QuantizationMethod(
    "fp8", "fp8:Fp8Config", "float8 e4m3 weights (tensor, channel, block), activations e4m3; or fp8 at load",
    kernels=("weight-only", "w8a8")))
register_method(QuantizationMethod(
    "compressed-tensors", "compressed_tensors:CompressedTensorsConfig",
    "llm-compressor's pack-quantized, int-quantized, float-quantized (W4A16, W8A16, W8A8, W4A8)",
    aliases=("compressed_tensors",), kernels=("weight-only", "w8a8", "w4a8")))
register_method(QuantizationMethod(
    "awq", "awq:AwqConfig", "AutoAWQ int4 (gemm layout)", aliases=("awq_marlin",), kernels=("weight-only",)))
register_method(QuantizationMethod(
    "gptq", "gptq:GptqConfig", "AutoGPTQ / GPTQModel int2/4/8", aliases=("gptq_marlin",), kernels=("weight-only",)))
register_method(QuantizationMethod(
    "mxfp4", "mxfp4:Mxfp4Config", "OCP MXFP4 expert weights (gpt-oss), dequantized at load",
    every_architecture=False))
