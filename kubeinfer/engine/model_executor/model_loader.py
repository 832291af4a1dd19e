"""Load a Hugging Face model's weights from safetensors (sharded or not) into the engine's model, as the
directory was inspected (model_files.py: config, architecture, quantization, EOS ids). Weights are read from
safetensors only: pickle checkpoints can execute code."""
from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import FUSED_WEIGHTS, ModelSpec
from .checkpoint_shapes import check_int_weight
from .expert_int_weights import ExpertIntegers
from .int_weights import rank_int_weight
from ..platforms.cpu import native_lm_head
from .layers import deferred_weight
from .layers.attention import AttentionBackend
from ..platforms.cpu.cpu_blas import use_openblas_for_small_steps
from .layers.quantization import QuantizationError, fp8, kernel_registry, linear_method, w8a8
from .layers.quantization.kv_cache_dtype import SCALE_KEY as KV_SCALE_KEY
from .layers.quantization.w8a8 import hold_int4
from .layers.rotary_embedding import RotaryEmbedding
from .model_files import ModelFiles, ModelLoadError, inspect_model_dir, resolve_dtype  # noqa: F401 (their home before)
from .models.llama import CausalLM
from .models.registry import ARCHITECTURES, model_class
from .quantized_head import untie_quantized_head

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
logger = logging.getLogger(__name__)


def load_model(files: ModelFiles, backend: AttentionBackend, max_positions: int, device: torch.device,
               dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1) -> CausalLM:
    """With tensor parallelism (`tp_size` > 1), this rank's slice of the model."""
    spec = ModelSpec(files.config, files.architecture).for_rank(tp_rank, tp_size)
    with torch.device("meta"):
        model = model_class(files.architecture)(spec, backend, max_positions)
    # experts that will be kept quantized never allocate their float stacks (allocated if a layer falls back);
    # --quantization fp8's too: each expert's float weight quantized as it is read (expert_int_weights.py)
    keeps = _keeps(files.quantization, device)
    deferred = {m: m.defer_stacks() for m in getattr(model, "experts_modules", dict)().values()} if keeps else {}
    # so do the dense projections' float weights (allocated when written in float: layers/deferred_weight.py)
    linears = deferred_weight.defer(model) if keeps else []
    model = model.to_empty(device=device).to(dtype)
    for moe, stacks in deferred.items():
        moe.restore_deferred(stacks, device, dtype)
    deferred_weight.restore(linears, device, dtype)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    untie_quantized_head(model, files.weight_files, files.quantization)  # tied, but the checkpoint quantizes the head
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build(device)
    _load_weights(model, files.weight_files, files.quantization)
    if unwritten := deferred_weight.unwritten(linears):
        raise ModelLoadError(f"{len(unwritten)} linear weights were neither kept quantized nor loaded")
    dequantized = [n for n, k in getattr(model, "expert_kernels", {}).items() if k == "dequantized"]
    if files.quantization is not None and hasattr(model, "experts_modules") and (
            dequantized or not getattr(model, "expert_kernels", None)):  # else: kept (layers/fused_moe/int_experts.py)
        how = "quantized to fp8 at load and dequantized back (no kept fp8 expert kernel on this device, or experts " \
              "stacked in the checkpoint: the float model's memory)" if getattr(files.quantization, "at_load", False) \
            else "dequantized at load"
        logger.info("%s: expert weights of %d MoE layers %s into stacked %s tensors", files.architecture,
                    len(dequantized) or len(model.experts_modules()), how, str(dtype).removeprefix("torch."))
    if backend.name == "triton":  # the GPU path: its norm and rotary kernels come with it
        model.use_triton_kernels()
    # The CPU's small-step matmuls; not the GPU. Not with tensor parallelism: its ranks share the cores.
    # A float32 model whose every linear layer is kept int (a quantized lm_head too) has nothing for OpenBLAS, but its
    # small steps still want torch on one thread beside the native kernels' pool (cpu_blas.py): 2 threads made the
    # sampler's argmax 4-7 ms a step, against 0.2
    model.openblas_small_steps = tp_size == 1 and (use_openblas_for_small_steps(model) or (
        dtype == torch.float32 and any(k.startswith("cpu_int") for k in getattr(model, "quant_kernels", {}).values())))
    if model.openblas_small_steps:  # then the logits product of small steps on the native pool, where it applies
        native_lm_head.use_native_lm_head(model)
    return model.eval()


def _load_weights(model: CausalLM, weight_files: list[Path], quantization=None) -> None:
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    expected = {name: 1 for name in params}
    for ours, _, _ in () if model.checkpoint_fused else FUSED_WEIGHTS:  # complete when all its slices arrived
        for name in params:
            if f".{ours}." in name:
                expected[name] = 3 if ours == "qkv_proj" else 2
    loaded: dict[str, int] = {}
    # MoE models load expert tensors themselves: stacked whatever the checkpoint's layout (models/moe.py)
    special = getattr(model, "load_special_weight", None)
    if special is not None:
        expected.update((name, count) for name, count in model.expected_loads().items() if name in params)
    # int8/int4 (on CUDA also fp8) checkpoint weights kept quantized (layers/quantization/linear_method.py), per
    # target and slice; under tensor parallelism each rank keeps its slice of the integers (int_weights.py)
    weight = next(iter(params.values()))
    split = getattr(model.spec, "tp_size", 1) > 1
    keep = _keeps(quantization, weight.device)
    integers: dict[str, dict] = {}
    kernels: dict[str, str] = {}  # {layer: kernel} of the kept-quantized layers, installed as each completes
    # --quantization fp8 on a float checkpoint: the decoder's projections and experts (not embeddings, lm_head,
    # norms or routers)
    at_load = fp8.prepare_at_load(model, quantization) if getattr(quantization, "at_load", False) else set()
    with ExitStack() as stack:  # every shard open: a weight's scale may sit in another shard
        handles = {}
        for file in weight_files:
            f = stack.enter_context(safe_open(str(file), framework="pt"))
            handles.update((key, (f, file)) for key in f.keys())
        # MoE experts kept as integers / fp8 too, stacked per layer once every shard is read (expert_int_weights.py;
        # --quantization fp8: each float expert weight quantized per channel as it is read)
        w8a8_checkpoint = any(s.inputs for s in getattr(quantization, "schemes", ()))  # compressed-tensors W8A8
        log = kernel_registry.ChoiceLog(getattr(quantization, "method", None))  # each kernel choice said once
        experts = ExpertIntegers(model, quantization, _tensor_getter(handles), weight.device, weight.dtype,
                                 w8a8_checkpoint) if keep and special else None
        for key, (f, file) in handles.items():
            if (quantization is not None and quantization.auxiliary(key)) or KV_SCALE_KEY.search(key):
                continue  # read with its weight, or the KV cache's scales (read by kv_cache_dtype.py)
            ours = model.checkpoint_name(key if quantization is None else quantization.weight_key(key))
            if ours is None or "rotary_emb.inv_freq" in ours:
                continue
            if ours == "lm_head.weight" and _tied(model):
                continue
            # kept --quantization fp8: a dense projection is kept here, Qwen2-MoE's shared expert gate/up too (the
            # MoE loader would store it in float)
            dense_kept = at_load and keep and not model.checkpoint_fused and _target(ours)[0] in at_load
            if special is not None and not dense_kept:
                try:
                    filled = experts.take(ours, key, f) if experts is not None else None
                    filled = filled or special(ours, key, lambda k: _read(k, handles[k][0], handles, quantization)
                                     if k in handles else None)
                except ValueError as error:  # named by its checkpoint key where the message does not name it
                    where = f"{file.name}" if key in str(error) else f"{file.name}: {key}"
                    raise ModelLoadError(f"{where}: {error}") from None
                if filled is not None:
                    for name, count in filled.items():
                        loaded[name] = loaded.get(name, 0) + count
                    continue
            name, shard = (ours, None) if model.checkpoint_fused else _target(ours)
            if name not in params:
                raise ModelLoadError(f"unexpected weight {key!r} in {file.name}: the checkpoint does not match its config")
            module = modules[name.rpartition(".")[0]]
            kept = keep and (not at_load or name in at_load)  # at load: only the projections fp8 quantizes
            parts = _int_weight(key, f, handles, quantization, module, params[name], shard, split) if kept else None
            if parts is not None:
                integers.setdefault(name, {})[shard] = parts
                loaded[name] = loaded.get(name, 0) + 1
                if len(integers[name]) == expected[name]:  # installed at once: one layer's integers in transit
                    complete = {name: integers.pop(name)}
                    kernels.update(_install_integers(model, params, complete, expected, w8a8_checkpoint, log))
                continue
            params[name] = deferred_weight.allocated(module, params[name])  # a deferred weight written in float
            if hasattr(module, "weight_pieces") and quantization is None and not _stored_as_fp8(f, key):
                tensor = LazySlice(f, key)  # a split layer reads only its rank's slice
            else:  # other quantized weights are dequantized whole (their scales cover the tensor), then cut
                tensor = _read(key, f, handles, quantization)
            if name in at_load:
                tensor = fp8.roundtrip_per_channel(tensor, quantization, key)
            if hasattr(module, "weight_pieces"):
                for target, piece in module.weight_pieces(params[name], tensor, shard):
                    _copy_checked(target, piece, name, shard)
            else:
                _copy_into(params[name], tensor, shard, model, name)
            loaded[name] = loaded.get(name, 0) + 1
        model.quant_kernels = kernels | _install_integers(model, params, integers, expected, w8a8_checkpoint, log)
        try:  # W8A8: the quantized layers' inputs quantized as the checkpoint says (static scales read here)
            model.activation_schemes = w8a8.install(model, quantization, handles, _tensor_getter(handles),
                                                    (lambda k: (k, None)) if model.checkpoint_fused else _target)
            if experts is not None:  # the layers not installed as their last expert weight was read
                model.expert_kernels = experts.install()
        except QuantizationError as error:
            raise ModelLoadError(str(error)) from None
    missing = [n for n, count in expected.items() if loaded.get(n, 0) < count]
    if _tied(model):
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        raise ModelLoadError(f"weights missing from the checkpoint: {', '.join(missing[:8])}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _tied(model: CausalLM) -> bool:
    """The head reads the embedding's weight (not where a quantized head was untied: quantized_head.py)."""
    return model.spec.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight


def _read(key: str, f, handles: dict, quantization) -> torch.Tensor:
    """The tensor as the model uses it: a quantized weight dequantized by its format (layers/quantization)."""
    tensor = f.get_tensor(key)
    if quantization is None:
        if fp8.is_fp8(tensor) or tensor.dtype in (torch.int8, torch.int32):
            raise ModelLoadError(f"weight {key!r} is stored as {tensor.dtype} but config.json has no "
                                 "quantization_config; kubeinfer cannot tell its scales")
        return tensor
    try:
        return quantization.read(key, tensor, _tensor_getter(handles))
    except QuantizationError as error:
        raise ModelLoadError(str(error)) from None


def _tensor_getter(handles: dict):
    """`get(key)`, as the formats read a weight's scales: the tensor from whichever shard holds it, or None."""
    return lambda key: handles[key][0].get_tensor(key) if key in handles else None


def _keeps(quantization, device: torch.device) -> bool:
    """Whether the format's integer (fp8) weights are handed over kept, not dequantized as read."""
    return hasattr(quantization, "int_weight") and linear_method.keeps_quantized(
        device, None, fp8=isinstance(quantization, fp8.Fp8Config) or _float_quantized(quantization))


def _float_quantized(quantization) -> bool:
    """compressed-tensors with only e4m3 weights (float-quantized): kept where fp8 is (CUDA)."""
    schemes = getattr(quantization, "schemes", ())
    return bool(schemes) and all(s.type == "float" for s in schemes)


def _int_weight(key: str, f, handles: dict, quantization, module, param, shard, split: bool):
    try:
        return rank_int_weight(quantization, key, f, _tensor_getter(handles),
                               module, param, shard, split)
    except QuantizationError as error:
        raise ModelLoadError(str(error)) from None


def _install_integers(model: CausalLM, params: dict, integers: dict[str, dict], expected: dict[str, int],
                      w8a8: bool, log=None) -> dict[str, str]:
    """Kept-quantized weights onto their layers; a fused weight with a slice that had to be dequantized is
    dequantized whole. Returns {layer: kernel} (linear_method.install)."""
    whole = {}
    for name, slices in integers.items():
        if len(slices) == expected[name]:
            rows, cols = params[name].shape
            order = sorted(slices, key=lambda s: s or 0)
            for shard in order if len(order) > 1 else ():  # each slice's columns and grids before they are joined
                check_int_weight(_slice_name(name, shard), slices[shard], None, cols)
            parts = [slices[k] for k in order]
            weight = parts[0] if len(parts) == 1 else linear_method.IntWeight.cat(parts)
            check_int_weight(name, weight, rows, cols)  # before any kernel packs it (checkpoint_shapes.py)
            whole[name] = weight
        else:
            params[name] = deferred_weight.allocated(model.get_submodule(name.removesuffix(".weight")))
            for shard, part in slices.items():
                _copy_into(params[name], part.dequantize(), shard, model, name)
    dtype = next(iter(params.values())).dtype
    if w8a8:  # int4 weights W4A8's exact product may take: held until w8a8.install reads their activations
        whole = hold_int4(model, whole, dtype)
    return linear_method.install(model, whole, dtype, w8a8, log)


def _slice_name(name: str, shard: int) -> str:
    """A fused weight's slice as the checkpoint names it: qkv_proj's slice 1 is k_proj."""
    theirs = next((t for ours, t, s in FUSED_WEIGHTS if f".{ours}." in name and s == shard), None)
    return f"{name} (slice {shard})" if theirs is None else f"{name.replace(_fused_of(theirs), theirs)} (slice {shard})"


def _fused_of(theirs: str) -> str:
    return next(ours for ours, t, _ in FUSED_WEIGHTS if t == theirs)


def _target(key: str) -> tuple[str, int | None]:
    for ours, theirs, shard in FUSED_WEIGHTS:
        if f".{theirs}." in key:
            return key.replace(f".{theirs}.", f".{ours}."), shard
    return key, None


def _copy_into(param: torch.Tensor, tensor: torch.Tensor, shard: int | None, model: CausalLM, name: str) -> None:
    with torch.no_grad():
        if shard is None:
            target = param
        else:
            spec = model.spec
            if "qkv_proj" in name:
                q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
                offsets, sizes = [0, q, q + kv], [q, kv, kv]
            else:
                offsets, sizes = [0, spec.intermediate_size], [spec.intermediate_size] * 2
            target = param.narrow(0, offsets[shard], sizes[shard])
        _copy_checked(target, tensor, name, shard)


def _copy_checked(target: torch.Tensor, tensor: torch.Tensor, name: str, shard: int | None) -> None:
    if target.shape != tensor.shape:
        what = name if shard is None else _slice_name(name, shard)
        raise ModelLoadError(f"weight {what} has shape {tuple(tensor.shape)}, the config implies {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)


def _stored_as_fp8(f, key: str) -> bool:
    return f.get_slice(key).get_dtype().startswith("F8")


class LazySlice:
    """A checkpoint tensor not yet read: `narrow` reads only the rows or columns asked for."""

    def __init__(self, f, key: str) -> None:
        self._slice = f.get_slice(key)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._slice[(slice(None),) * dim + (slice(start, start + length),)]
