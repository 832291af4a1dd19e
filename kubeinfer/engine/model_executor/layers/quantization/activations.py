"""Activation quantization of W8A8 checkpoints (int8 or FP8 e4m3 inputs to a quantized linear layer), exact to
the compressed-tensors package's numerics, which transformers runs for these checkpoints
(`CompressedTensorsConfig()`: its forward wrapper fake-quantizes each linear's input on every call):

- dynamic scales, per token (one per row of [tokens, hidden]) or per group of `group_size` columns of a
  token: min and max taken with 0, symmetric scale = max(|min|, |max|) / ((q_max - q_min) / 2) (int8:
  amax / 127.5, not vLLM's amax / 127; e4m3: amax / 448), asymmetric scale = (max - min) / (q_max - q_min) and
  zero point = clamp(q_min - min / scale) rounded to int8; a zero scale becomes the dtype's eps;
- static scales (and zero points) from the checkpoint, one per tensor;
- quantize: x / scale (+ zero), clamped to [q_min, q_max], then rounded half to even (int) or cast to e4m3
  (float); dequantize: (q - zero) * scale, all in the activation's dtype.

The product: the quantized activation multiplies the layer's (dequantized or kept-quantized) weight. On the
CPU, fake quantization (quantize-dequantize, then the float product: the reference's own computation) against
torch._int_mm (int8 x int8 -> exact int32 sums, then both scales: `int8_linear`, separable for the int8
weight kernels), `python benchmarks/bench_w8a8.py`, one [tokens, 2048] x [8192, 2048] float32 product,
interleaved, on the 2-core CPU at load average ~9: _int_mm / fake quantization 0.92-1.00 at 1 token,
1.00-1.01 at 16, 0.44-0.67 at 64 (benchmarks/RESULTS.md, section w8a8), and it holds the weight in int8 (a
quarter of float32's bytes). So a float32 CPU model runs int8 per-token W8A8 layers through _int_mm, or
the native VNNI kernel that gives its bits faster (platforms/cpu/native/; w8a8.py; equal to the reference up to float
accumulation order), and everything else (FP8, static or
group scales, bf16, CUDA) through fake quantization, the same torch code on every device (no CUDA kernel
here could be checked). Dynamic per-tensor scales are refused: the reference takes them over one forward
call's tokens, which batching changes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import QuantizationError

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


@dataclass(frozen=True)
class ActivationScheme:
    type: str  # int | float (e4m3)
    strategy: str  # token | group | tensor
    dynamic: bool
    symmetric: bool = True
    group_size: int | None = None

    @classmethod
    def from_args(cls, args: dict, where: str) -> ActivationScheme:
        """A compressed-tensors `input_activations` entry; unserved settings are refused by name."""
        kind, bits = str(args.get("type", "int")).lower(), int(args.get("num_bits", 8))
        strategy = str(args.get("strategy") or "tensor").lower()
        dynamic, symmetric = args.get("dynamic", False), bool(args.get("symmetric", True))
        if (kind, bits) not in (("int", 8), ("float", 8)):
            raise QuantizationError(f"{where}: {kind}{bits} input activations are not served; int8 and float8 are")
        if dynamic == "local":
            raise QuantizationError(f"{where}: 'local' dynamic activations (NVFP4 global scales) are not served")
        if dynamic and strategy not in ("token", "group"):
            raise QuantizationError(f"{where}: dynamic {strategy!r} activation scales are not served: the reference "
                                    "takes them over one forward call's tokens, which batching changes; token and "
                                    "group are served")
        if not dynamic and strategy != "tensor":
            raise QuantizationError(f"{where}: static {strategy!r} activation scales are not served; tensor is")
        if kind == "float" and not symmetric:
            raise QuantizationError(f"{where}: asymmetric float8 activations are not defined")
        group = args.get("group_size")
        if strategy == "group" and (not isinstance(group, int) or group < 1):
            raise QuantizationError(f"{where}: group activation quantization needs a positive group_size")
        if args.get("scale_dtype") or args.get("global_scale"):
            raise QuantizationError(f"{where}: activation scale_dtype / global scales are not served")
        return cls(kind, strategy, bool(dynamic), symmetric, group if strategy == "group" else None)

    def describe(self) -> str:
        kind = "int8" if self.type == "int" else "fp8 e4m3"
        how = f"per group of {self.group_size}" if self.strategy == "group" else f"per {self.strategy}"
        return f"{kind} {'dynamic' if self.dynamic else 'static'} {how}{'' if self.symmetric else ' asymmetric'}"


def q_range(scheme: ActivationScheme) -> tuple[float, float]:
    """[q_min, q_max]. Python numbers, not the reference's 0-dim float32 tensors: no host-to-device copy in a
    captured CUDA graph, and the same results (these are exact in every float dtype, and a 0-dim tensor does
    not change the result dtype either; the bfloat16 layer test checks it). As a divisor they become a tensor
    on the device first (dynamic_qparams): torch on CUDA multiplies by a host number's reciprocal."""
    return (-128.0, 127.0) if scheme.type == "int" else (-FP8_MAX, FP8_MAX)


def dynamic_qparams(x: torch.Tensor, scheme: ActivationScheme, reduce_range=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each token ([..., 1]) or token group ([..., groups]) of x [..., hidden].
    `reduce_range(lo, hi)`: the whole token's min and max from a tensor-parallel rank's slice of its columns
    (w8a8_tp.py); min and max are exact, so the scales are those of the whole token."""
    if scheme.strategy == "group":
        x = _grouped(x, scheme.group_size)
    lo, hi = x.amin(dim=-1), x.amax(dim=-1)
    if scheme.strategy == "token":
        lo, hi = lo.unsqueeze(-1), hi.unsqueeze(-1)
    lo, hi = torch.min(lo, torch.zeros_like(lo)), torch.max(hi, torch.zeros_like(hi))
    if reduce_range is not None:
        lo, hi = reduce_range(lo, hi)
    q_min, q_max = q_range(scheme)
    # Divided by a tensor on x's device, as the reference divides by its range tensor: a host number torch on
    # CUDA turns into a multiply by its float32 reciprocal (BinaryDivTrueKernel.cu), a scale 1 ulp off in some
    # rows, which moved W8A8 outputs on the first GPU run; the CPU divides either way. Exact in every dtype.
    span = q_max - q_min
    if scheme.symmetric:
        scale = torch.max(lo.abs(), hi.abs()) / lo.new_full((), span / 2)
        zero = torch.zeros(scale.shape, device=x.device, dtype=lo.dtype)
    else:
        scale = (hi - lo) / lo.new_full((), span)
        zero = torch.clamp(q_min - lo / scale, q_min, q_max)
    scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    zero = _zero_point_dtype(zero, scheme)
    return scale, zero


def _zero_point_dtype(zero: torch.Tensor, scheme: ActivationScheme) -> torch.Tensor:
    if scheme.type == "int":
        return torch.round(torch.clamp(zero, -128, 127)).to(torch.int8)
    return torch.clamp(zero, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """[..., cols] as [..., groups, group]; a last partial group is padded with zeros, which change neither its
    min and max (both are taken with 0) nor the columns it has (the reference needs whole groups)."""
    pad = -x.shape[-1] % group
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.unflatten(-1, (x.shape[-1] // group, group))


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: ActivationScheme,
             dequantize: bool = True) -> torch.Tensor:
    """x quantized (and dequantized back, in x's dtype: fake quantization) with the given scale / zero point;
    without `dequantize`, the int8 or e4m3 values."""
    grouped = scheme.strategy == "group"
    if grouped:
        shape, x = x.shape, _grouped(x, scheme.group_size)
        scale = scale.unsqueeze(-1)
        zero = None if zero is None else zero.unsqueeze(-1)
    q_min, q_max = q_range(scheme)
    scaled = x / scale
    if zero is not None:
        scaled += zero.to(x.dtype)
    clamped = torch.clamp(scaled, q_min, q_max)
    rounded = torch.round(clamped) if scheme.type == "int" else clamped.to(torch.float8_e4m3fn)
    if not dequantize:
        values = rounded.to(torch.int8) if scheme.type == "int" else rounded
        return values.flatten(-2)[..., :shape[-1]] if grouped else values
    out = rounded.to(x.dtype).to(scale.dtype)
    if zero is not None:
        out = out - zero.to(scale.dtype)
    out = out * scale
    return out.flatten(-2)[..., :shape[-1]] if grouped else out


def fake_quantize(x: torch.Tensor, scheme: ActivationScheme, scale: torch.Tensor | None = None,
                  zero: torch.Tensor | None = None, reduce_range=None) -> torch.Tensor:
    """The layer input as the reference multiplies it: dynamic scales computed from x (and `reduce_range`, as
    dynamic_qparams), else the static ones."""
    if x.numel() == 0:
        return x
    if scheme.dynamic:
        scale, zero = dynamic_qparams(x, scheme, reduce_range)
    return quantize(x, scale, zero, scheme)


def int8_linear(x: torch.Tensor, scheme: ActivationScheme, weight_t: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, reduce_range=None) -> torch.Tensor:
    """The int8 W8A8 product through torch._int_mm: x [..., in] quantized per token (symmetric, dynamic),
    `weight_t` int8 [in, out] (transposed, contiguous), `weight_scale` [out] float32. Equals fake quantization
    then the float product up to accumulation order (exact int32 sums, then both scales)."""
    assert scheme.type == "int" and scheme.symmetric and scheme.strategy == "token" and scheme.dynamic
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    scale, _ = dynamic_qparams(rows, scheme, reduce_range)
    q = quantize(rows, scale, None, scheme, dequantize=False)
    out = torch._int_mm(q, weight_t).to(torch.float32) * scale.to(torch.float32) * weight_scale
    out = out.to(x.dtype).reshape(*shape[:-1], -1)
    return out if bias is None else out + bias
