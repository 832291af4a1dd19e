"""W8A8 layers: the input of each linear layer whose checkpoint weight is quantized with an activation scheme
(compressed-tensors `input_activations`, the fp8 method's `activation_scheme`) is quantized as the scheme says
(activations.py) before the layer's own product: the dense dequantized weight, or its kept-quantized kernel
(linear_method.py). A fused projection (q/k/v, gate/up) whose parts carry different static input scales
quantizes the input once per part and keeps each part's output columns, as the reference's separate layers do.

W4A8 (int4 weights with int8 dynamic per-token activations, llm-compressor's W4A8): the loader holds the int4
weights (`hold_int4`), and `install` gives each such layer the exact int4 x int8 product, its weight packed
(w4a8.py; w4a8_vnni, or w4a8_int_mm where KUBEINFER_W8A8_KERNEL=int_mm asks or the native library does not
build); held weights of layers whose scheme it does not take are dequantized and run as any W8A8 layer.

LoRA over a W8A8 base: the adapter's delta is computed beside the base product from the unquantized input
(models/llama.py `_project`), as PEFT does (its LoRA layer calls the wrapped base layer, whose forward
fake-quantizes the input, and feeds lora_A the original input) and vLLM does (the base quant method
quantizes inside its apply; the LoRA shrink reads the layer's input)."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from kubeinfer.engine.kernel_config import setting as kernel_setting
from ..deferred_weight import device_of
from . import w4a8
from .activations import ActivationScheme, fake_quantize, int8_linear
from ....platforms.cpu.native import ops as native_ops
from .errors import QuantizationError
from .kernel_registry import Choice, ChoiceLog
from .linear_method import attach, dense
from .w8a8_experts import ExpertSchemes
from .w8a8_kernels import W4A8, W8A8, ExactTarget, w4a8_forced, w8a8_forced
from .w8a8_tp import check as check_tensor_parallel
from .w8a8_tp import range_reducer, rank_rows

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")  # a quantized weight's scale: its module is quantized


class ActivationQuantMethod:
    """`segments`: (first output column, columns, static scale index) per part; one part when the whole
    layer shares its input's quantization (dynamic scales, or equal static ones)."""

    def __init__(self, layer: nn.Linear, scheme: ActivationScheme, inner, segments: list[tuple[int, int, int]],
                 scales: torch.Tensor | None, zeros: torch.Tensor | None,
                 int_mm: tuple[torch.Tensor, torch.Tensor] | None = None, kernel: str | None = None) -> None:
        self.scheme, self.inner, self.segments, self.kernel = scheme, inner, segments, "fake_quant"
        self.reduce_range = range_reducer(layer, scheme)  # a row-parallel rank's token range made whole (w8a8_tp)
        if int_mm is not None:  # int8 weights [in, out] and their row scales replace the float weight
            # parameters, as linear_method's: the start-up log's weight bytes count them
            self.kernel = kernel or _int8_kernel(int_mm[0].shape[0])  # w8a8_kernels.py's choice
            # the native kernel's layout (platforms/cpu/native/kernels.c), one byte a weight
            if self.kernel == "int8_vnni":
                layer.register_parameter("qweight_vnni", nn.Parameter(native_ops.pack_int8(int_mm[0].t()),
                                                                      requires_grad=False))
            else:
                layer.register_parameter("qweight_t", nn.Parameter(int_mm[0], requires_grad=False))
            layer.register_parameter("weight_row_scale", nn.Parameter(int_mm[1], requires_grad=False))
            layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=layer.weight.dtype, device="meta"),
                                        requires_grad=False)
        if scales is not None:  # static: buffers, so .to() and CUDA graphs see them on the device
            # in the model dtype, as the reference's input_scale parameter holds it
            device = next(p.device for p in layer.parameters() if p.device.type != "meta")
            layer.register_buffer("input_scale", scales.to(device, layer.weight.dtype), persistent=False)
            if zeros is not None:
                layer.register_buffer("input_zero_point", zeros.to(device), persistent=False)

    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """`bias=False`: the product alone, as the other quant methods' (a row-parallel layer adds its bias)."""
        if self.kernel == "int8_vnni":
            return native_ops.w8a8_linear(x, self.scheme, layer.qweight_vnni, layer.weight_row_scale,
                                          layer.bias if bias else None, self.reduce_range)
        if self.kernel == "int_mm":
            return int8_linear(x, self.scheme, layer.qweight_t, layer.weight_row_scale, layer.bias if bias else None,
                               self.reduce_range)
        if self.scheme.dynamic:
            return self.inner(layer, fake_quantize(x, self.scheme, reduce_range=self.reduce_range), bias)
        zeros = getattr(layer, "input_zero_point", None)
        outs = []
        for start, size, index in self.segments:
            scale = layer.input_scale[index:index + 1]
            zero = None if zeros is None else zeros[index:index + 1]
            out = self.inner(layer, fake_quantize(x, self.scheme, scale, zero), bias)
            outs.append(out if len(self.segments) == 1 else out[..., start:start + size])
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def install(model: nn.Module, quantization, keys, get, target) -> dict[str, str]:
    """Each linear layer whose checkpoint weight has an activation scheme quantizes its input; returns
    {layer: scheme description}. `keys`: the checkpoint's tensor names; `get(key)`: a tensor or None;
    `target(name)`: (our fused parameter, part index or None) of a checkpoint parameter name."""
    scheme_of = getattr(quantization, "input_activations", None)
    if scheme_of is None:
        return {}
    parts: dict[str, dict] = {}
    experts = ExpertSchemes(model)  # MoE experts' projections: w8a8_experts.py
    if getattr(quantization, "at_load", False):  # --quantization fp8: the projections the loader quantized
        routers = model.router_names() if hasattr(model, "router_names") else set()  # float, not quantized
        keys = [f"{n}.weight_scale" for n, m in model.named_modules()
                if isinstance(m, nn.Linear) and n != "lm_head" and n not in routers]
        experts.at_load(scheme_of(""))
    for key in keys:
        if not key.endswith(SCALE_SUFFIXES):
            continue
        module = key.rsplit(".", 1)[0]
        scheme = scheme_of(module)
        ours = model.checkpoint_name(f"{module}.weight") if scheme is not None else None
        static = partial(_static, quantization, module, scheme, get)  # an expert's scales, read by experts.take
        if ours is None or experts.take(ours, module, scheme, static):
            continue
        name, shard = target(ours)
        layer = _linear(model, name.removesuffix(".weight"), module)
        parts.setdefault(name.removesuffix(".weight"), {})[shard] = (scheme, layer, *_static(quantization, module,
                                                                                              scheme, get), module)
    installed, log = {}, ChoiceLog(getattr(quantization, "method", None))
    for name, shards in parts.items():
        schemes = {s[0] for s in shards.values()}
        if len(schemes) != 1:
            raise QuantizationError(f"the parts fused into {name} quantize their input differently: "
                                    f"{', '.join(s.describe() for s in schemes)}")
        scheme, layer = next(iter(shards.values()))[:2]
        check_tensor_parallel(layer, scheme, name)
        int4 = _int4_kernel(layer, scheme)
        held = w4a8.take(layer, scheme, int4 and int4.name)  # int4 weights held for W4A8 (w4a8.py)
        if held is not None:
            log.note(name, int4, W4A8.product)
            attach(layer, held)
            installed[name] = f"{scheme.describe()} ({held.kernel})"
            continue
        inner = getattr(layer, "quant_method", None)
        segments, scales, zeros = _segments(layer, shards, scheme)
        int_mm, exact = None, inner is None and _int_mm_applies(layer, scheme)
        if exact:
            order = sorted(shards, key=lambda s: -1 if s is None else s)
            int_mm = _int8_weight(layer, [rank_rows(layer, get(f"{shards[k][4]}.weight_scale"), k) for k in order])
        choice = W8A8.choose(ExactTarget(name, exact, int_mm is not None, 0 if int_mm is None else len(int_mm[0])),
                             w8a8_forced(wanted_kernel()))
        log.note(name, choice, W8A8.product)
        method = ActivationQuantMethod(layer, scheme, inner.apply if inner is not None else dense, segments,
                                       scales, zeros, int_mm if choice.name != "fake_quant" else None, choice.name)
        attach(layer, method)
        installed[name] = f"{scheme.describe()} ({method.kernel})"
    w4a8.release(model)  # held int4 weights of layers that quantize no activations: dequantized
    return {**installed, **experts.install()}


def hold_int4(model: nn.Module, weights: dict, dtype: torch.dtype) -> dict:
    """The loader's int4 weights of a checkpoint with activation schemes that W4A8's exact product could take, held
    on their layers until `install` reads the layers' schemes (w4a8.py); returns the others. None held under
    KUBEINFER_W8A8_KERNEL=fake_quant."""
    return weights if wanted_kernel() == "fake_quant" else w4a8.hold(model, weights, dtype)


def _linear(model: nn.Module, name: str, module: str) -> nn.Linear:
    try:
        layer = model.get_submodule(name)
    except AttributeError:
        layer = None
    if not isinstance(layer, nn.Linear):
        raise QuantizationError(f"{module} quantizes its input activations, but it is no linear layer of kubeinfer's "
                                "model (W8A8 experts are served from per-expert checkpoint tensors only)")
    return layer


def _static(quantization, module: str, scheme: ActivationScheme, get) -> tuple:
    if scheme.dynamic:
        return None, None
    scale = next((get(f"{module}.{n}") for n in quantization.input_scale_names if get(f"{module}.{n}") is not None),
                 None)
    if scale is None or scale.numel() != 1:
        raise QuantizationError(f"{module} has static input activations but the checkpoint has no one-value "
                                f"{' or '.join(quantization.input_scale_names)} for it")
    zero = None
    if not scheme.symmetric:
        zero = get(f"{module}.input_zero_point")
        if zero is None or zero.numel() != 1:
            raise QuantizationError(f"{module} has asymmetric static input activations but no one-value "
                                    "input_zero_point in the checkpoint")
        zero = zero.reshape(1).to(torch.int8)
    return scale.reshape(1).to(torch.float32), zero


def _segments(layer: nn.Linear, shards: dict, scheme: ActivationScheme):
    """(segments, static scales [parts], static zeros [parts] or None) of a layer's parts."""
    if scheme.dynamic:
        return [(0, layer.out_features, 0)], None, None
    order = sorted(shards, key=lambda s: -1 if s is None else s)
    scales = torch.cat([shards[s][2] for s in order])
    zeros = None if scheme.symmetric else torch.cat([shards[s][3] for s in order])
    if order == [None] or (bool((scales == scales[0]).all()) and (zeros is None or bool((zeros == zeros[0]).all()))):
        return [(0, layer.out_features, 0)], scales[:1], None if zeros is None else zeros[:1]
    sizes = [p.size for p in getattr(layer, "parts", [])]
    if sorted(order) != list(range(len(sizes))):
        raise QuantizationError(f"the parts of {layer} have static input scales for parts {order} only")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(starts[i], sizes[i], i) for i in range(len(sizes))], scales, zeros


def _int_mm_applies(layer: nn.Linear, scheme: ActivationScheme) -> bool:
    """Exact int8 products (int32 sums) for a float32 CPU model's int8 inputs per token, with int8 weights held:
    torch._int_mm (activations.py: measured, it ties fake quantization at 1 and 16 tokens and wins at 64) or,
    where it builds, the native VNNI kernel (platforms/cpu/native/: the same bits; one [tokens, 2048] x [8192, 2048]
    product, activation quantization included, ms at 1 / 16 tokens: 0.55 / 1.78 against _int_mm's 1.79 / 2.45
    on one thread, 0.55 / 1.14 against 1.13 / 1.43 on two, same run, load 5.5; benchmarks/RESULTS.md
    "cpu-native-vnni"). Not under bf16/fp16: there the reference rounds the dequantized
    weight and input to that dtype, which the exact int32 sums would not. KUBEINFER_W8A8_KERNEL: int8_vnni
    (default; torch._int_mm without the native library), int_mm, fake_quant (the reference's own float product)."""
    wanted = wanted_kernel()
    return (wanted != "fake_quant" and device_of(layer).type == "cpu" and layer.weight.dtype == torch.float32
            and scheme.type == "int" and scheme.symmetric and scheme.dynamic and scheme.strategy == "token")


def _int4_kernel(layer: nn.Linear, scheme: ActivationScheme) -> Choice | None:
    """W4A8's kernel where the int8 one would apply (w8a8_kernels.py): w4a8_vnni (the native kernel) unless int_mm
    is asked for or the native library does not build, then w4a8_int_mm (torch._int_mm per weight group, the same
    bits)."""
    if not _int_mm_applies(layer, scheme):
        return None
    return W4A8.choose(ExactTarget(str(layer), True), w4a8_forced(wanted_kernel()))


def wanted_kernel() -> str:
    """The engine's kernels.w8a8_kernel (KUBEINFER_W8A8_KERNEL)."""
    try:
        return kernel_setting("w8a8_kernel")
    except ValueError as err:  # envs.EnvVarError; a quantization setting, refused as the others are
        raise QuantizationError(str(err)) from None


def _int8_kernel(inputs: int) -> str:
    """int8_vnni unless int_mm is asked for, the native library does not build (it warns once), or the inputs
    are too many for its int32 sums of (w + 128) * x (native_ops.MAX_INPUTS)."""
    return W8A8.choose(ExactTarget("a layer", True, True, inputs), w8a8_forced(wanted_kernel())).name


def _int8_weight(layer: nn.Linear, scales: list) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The layer's int8 weight [in, out] and row scales, recovered exactly from its dequantized weight (q * scale,
    the loader's float32 product), when the checkpoint's weights are int8 per output channel, symmetric."""
    if any(s is None for s in scales):
        return None
    scale = torch.cat([s.reshape(-1) for s in scales]).to(torch.float32)
    weight = layer.weight.detach()
    if scale.numel() != weight.shape[0] or not bool((scale > 0).all()):
        return None  # per tensor or per group, or an asymmetric checkpoint's zero points: fake quantization
    q = torch.round(weight.to(torch.float32) / scale[:, None])
    if q.min() < -128 or q.max() > 127 or not torch.equal((q * scale[:, None]).to(weight.dtype), weight):
        return None
    return q.to(torch.int8).t().contiguous(), scale
