"""A CPU decode step's Llama-family decoder layers in one native call (platforms/cpu/cpu_decoder.py,
platforms/cpu/native/
decoder_layer.c) instead of ~10 module calls each: at batch 1 the Python between the native kernels was ~40 us a
layer, a fifth of a 5.5 ms step. The same C kernels in the same order as the per-module path: the same bits.

Which layers: decided once, at the first step that asks: llama.py's DecoderLayer itself (not another family's),
RMSNorm norms (float32), the rotate-half rotary on the CPU, the torch attention backend without a score cap,
silu, every projection through A16Method (the float32 default, cpu_int8_a16 / cpu_int4_a16), NativeIntMethod
(KUBEINFER_QUANT_KERNEL=cpu_int8_vnni / cpu_int4_vnni) or W4A8Method's native kernel (w4a8_vnni: W4A8
checkpoints), tensor parallel size 1; Qwen3's q/k norms included.
Consecutive such layers are one call; the others run their forward.
Which steps, checked each step: decodes only (one token a sequence), no LoRA adapter in it, float32 activations,
KV caches of float32, bfloat16 or fp8 (e4m3 / e5m2; --kv-cache-dtype, checkpoint scales of 1.0: a scaled
backend does not qualify), the native layers on (`ops.layers_enabled()`: KUBEINFER_CPU_NATIVE_LAYERS) and
KUBEINFER_CPU_FUSED_LAYERS not 0 (default 1; 0 keeps the per-module path, for A/B measurements). Anything else
returns None and the model runs its layers one module at a time."""
from __future__ import annotations


import torch
import torch.nn.functional as F

from kubeinfer.engine.kernel_config import setting as kernel_setting
from . import cpu_decoder
from ...model_executor.layers.attention import TorchAttentionBackend
from ...model_executor.layers.layernorm import RMSNorm
from .native import ops
from .native.a16_method import A16Method
from .native.method import NativeIntMethod
from ...model_executor.layers.quantization.w4a8 import W4A8Method
from ...model_executor.layers.rotary_embedding import RotaryEmbedding

PLAN = "_native_decode_plan"


def switched_on() -> bool:
    return kernel_setting("cpu_fused_layers")  # the engine's (KUBEINFER_CPU_FUSED_LAYERS)


def _norm_ok(norm) -> bool:
    w = norm._parameters["weight"]
    return (type(norm) is RMSNorm and not norm.fused and w.dtype == torch.float32 and w.is_contiguous()
            and w.device.type == "cpu")


def _native(linear, tp_ok: bool = True) -> bool:
    method = getattr(linear, "quant_method", None)
    bias = linear._parameters.get("bias")
    w4a8 = type(method) is W4A8Method and method.kernel == "w4a8_vnni" and method.reduce_range is None
    return ((type(method) in (NativeIntMethod, A16Method) or w4a8) and tp_ok
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))


def qualifies(layer, spec, types: tuple) -> bool:
    """Whether this layer's decode is exactly what decoder_layer.c computes; types: llama.py's (DecoderLayer,
    Attention, MLP), exactly (a subclass may compute otherwise)."""
    layer_type, attn_type, mlp_type = types
    if type(layer) is not layer_type or spec.tp_size != 1:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not attn_type or type(mlp) is not mlp_type or attn.softcap or mlp.activation is not F.silu:
        return False
    rotary = attn.rotary
    if type(rotary) is not RotaryEmbedding or rotary.fused or rotary.cos.dtype != torch.float32:
        return False
    if type(attn.backend).forward is not TorchAttentionBackend.forward or attn.head_dim % 2:
        return False
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if attn.q_norm is not None:
        norms += [attn.q_norm, attn.k_norm]
    if not (all(_norm_ok(n) for n in norms) and _native(attn.qkv_proj) and _native(mlp.gate_up_proj)
            and _native(attn.o_proj, attn.o_proj.tp_size == 1) and _native(mlp.down_proj, mlp.down_proj.tp_size == 1)):
        return False
    hidden, inter, heads = layer.input_layernorm.weight.shape[0], mlp.intermediate_size, attn.num_heads * attn.head_dim
    shapes = [(attn.qkv_proj, hidden, heads + 2 * attn.num_kv_heads * attn.head_dim), (attn.o_proj, heads, hidden),
              (mlp.gate_up_proj, hidden, 2 * inter), (mlp.down_proj, inter, hidden)]  # what the C code assumes
    return (all(p.in_features == k and p.quant_method.out_features == n for p, k, n in shapes)
            and rotary.cos.shape[1] * 2 == attn.head_dim)


def _weight_ptr(norm) -> int | None:
    return None if norm is None else norm._parameters["weight"].data_ptr()


def describe(layer, windows: list, keep: list) -> cpu_decoder.Layer:
    attn, mlp = layer.self_attn, layer.mlp
    if attn.window not in windows:
        windows.append(attn.window)
    q_norm, k_norm = attn.q_norm, attn.k_norm
    tables = attn.rotary._buffers
    keep.extend([tables["cos"], tables["sin"]] + [n._parameters["weight"] for n in
                (layer.input_layernorm, layer.post_attention_layernorm, q_norm, k_norm) if n is not None])
    proj = cpu_decoder.proj
    return cpu_decoder.Layer(
        proj(attn.qkv_proj, keep), proj(attn.o_proj, keep), proj(mlp.gate_up_proj, keep), proj(mlp.down_proj, keep),
        _weight_ptr(layer.input_layernorm), _weight_ptr(layer.post_attention_layernorm), _weight_ptr(q_norm),
        _weight_ptr(k_norm), tables["cos"].data_ptr(), tables["sin"].data_ptr(), layer.input_layernorm.eps,
        layer.post_attention_layernorm.eps, q_norm.eps if q_norm else 0.0, k_norm.eps if k_norm else 0.0,
        attn.scale, attn.num_heads, attn.num_kv_heads, attn.head_dim, layer.input_layernorm.weight.shape[0],
        mlp.intermediate_size, tables["cos"].shape[0], windows.index(attn.window))


def plan(model) -> list | None:
    """[(first layer, Layers or None)...]: runs of qualifying layers and single others; None where no layer
    qualifies. Built once per model."""
    cached = model.__dict__.get(PLAN, False)
    if cached is not False:
        return cached
    steps, run, windows, keep = [], [], [], []
    layers = list(model.model.layers)

    def close(end: int) -> None:
        if run:
            steps.append((end - len(run), cpu_decoder.Layers(run, list(windows), list(keep))))
            run.clear(), windows.clear(), keep.clear()

    for i, layer in enumerate(layers):
        if qualifies(layer, model.spec, model.native_decode_types):
            run.append(describe(layer, windows, keep))
        else:
            close(i)
            steps.append((i, None))
    close(len(layers))
    result = steps if any(s is not None for _, s in steps) else None
    model.__dict__[PLAN] = result
    return result


def all_layers_native(model) -> bool:
    """Whether every decoder layer qualifies for the native call, the switches on: a decode step then runs its
    attention in C (the fused call; or, with LoRA, the per-module path's same native attention), and model_runner
    keeps torch on one thread however long the contexts."""
    if getattr(model, "native_decode_types", None) is None or not ops.available():
        return False
    steps = plan(model)
    return bool(steps) and all(run is not None for _, run in steps) and ops.layers_enabled() and switched_on()


def decode_attention_native(model) -> bool:
    """Whether a decode step's attention runs in C in every layer: all layers in the native call, or every
    attention module on the torch backend (not a scaled one) without a score cap or sinks, in float32 or
    bfloat16, the native layers on (cpu_attention.usable's conditions that hold for the whole model). Then
    model_runner keeps torch on one thread however long the contexts: nothing large is left to torch."""
    if all_layers_native(model):
        return True
    if not (ops.available() and ops.layers_enabled()):
        return False
    if "_decode_attention_native" not in model.__dict__:
        attentions = [m for m in model.modules() if "backend" in vars(m)]  # a scaled backend is no subclass
        model.__dict__["_decode_attention_native"] = bool(attentions) and all(
            type(m.backend).forward is TorchAttentionBackend.forward and not getattr(m, "softcap", None)
            and getattr(m, "sinks", None) is None for m in attentions) and next(
            model.parameters()).dtype in (torch.float32, torch.bfloat16)
    return model.__dict__["_decode_attention_native"]


def _meta_ok(meta, tokens: int) -> bool:
    tables, lens, slots = meta.block_tables, meta.context_lens_tensor, meta.slot_mapping
    return (tables.dtype == torch.long and tables.stride(1) == 1 and lens.dtype == torch.long and lens.is_contiguous()
            and slots.dtype == torch.long and slots.is_contiguous() and slots.shape[0] == tokens
            and tables.device.type == "cpu")


def forward_layers(model, x: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta, lora
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The decoder layers of a decode step (x: the embeddings) -> (output, residual), as the layer loop gives;
    None where this step is not one for the native layers (the caller loops over its layers)."""
    tokens = x.shape[0]
    if (lora is not None or meta.num_decodes != tokens or meta.num_seqs != tokens or not tokens
            or x.dtype is not torch.float32 or not x.is_cpu or x.dim() != 2 or positions.dtype is not torch.int64
            or positions.shape != (tokens,) or not positions.is_contiguous()):
        return None
    steps = model.__dict__.get(PLAN, False)
    if steps is False and ops.available():
        steps = plan(model)
    if not steps or not ops.layers_enabled() or not switched_on():
        return None
    x = x.contiguous()
    metas: dict = {}
    runs = []
    for first, run in steps:  # every check before anything runs: a step goes one way or the other
        if run is None:
            continue
        for window in run.windows:
            if window not in metas:
                metas[window] = meta.for_window(window)
                if not _meta_ok(metas[window], tokens):
                    return None
        caches = run.caches(kv_caches, first)
        if caches is None:
            return None
        runs.append(caches)
    residual, done = None, iter(runs)
    for first, run in steps:
        if run is None:
            x, residual = model.model.layers[first].forward(x, residual, positions, kv_caches[first], meta, lora)
        else:
            x, residual = run.run(x, residual, positions, next(done), [metas[w] for w in run.windows])
    return x, residual
