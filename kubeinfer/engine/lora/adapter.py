"""Read one LoRA adapter in PEFT format from disk and check it fits the base model.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors`. Everything is
validated before any tensor reaches the device, so a bad adapter is refused with a message that says
what to fix instead of failing mid-step. Pickle files (`adapter_model.bin`) are never opened: unpickling
runs code. The scaling (alpha/r, or alpha/sqrt(r) with rsLoRA) is folded into B here, once, so the
batched delta is a plain (x @ A.T) @ B.T.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..config import ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections an adapter may target, by their checkpoint (PEFT) names; Phi-3's checkpoints (and so its
# adapters) have qkv_proj and gate_up_proj instead of q/k/v and gate/up (`module_shapes` says which a model has).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_LORA_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "qkv_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "gate_up_proj": "mlp", "down_proj": "mlp"}

# PEFT saves `base_model.model.` + the module's name in the CausalLM + `.lora_A.weight`.
_KEY = re.compile(r"base_model\.model\.(model\.layers\.(\d+)\.(\w+)\.(\w+))\.lora_([AB])\.weight")

# A module nested under a layer's MLP: a mixture of experts' `mlp.experts.3.gate_proj`, `mlp.shared_expert.up_proj`.
_MOE_KEY = re.compile(r"base_model\.model\.(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.\w+\.[\w.]+?)"
                      r"\.lora_[AB]\.weight")

# Config switches whose adapters compute something other than x @ A.T @ B.T added to the output.
_UNSUPPORTED = {
    "use_dora": "DoRA adapters (use_dora) are not supported; merge the DoRA weights or retrain without it",
    "fan_in_fan_out": "fan_in_fan_out adapters (GPT-2 style Conv1D layers) are not supported",
    "modules_to_save": "adapters with modules_to_save (fully retrained modules) are not supported; "
                       "retrain with modules_to_save=None",
    "lora_bias": "adapters with a LoRA bias (lora_bias=True) are not supported",
    "target_parameters": "adapters targeting parameters (target_parameters, e.g. a mixture of experts' stacked "
                         "experts) are not supported",
    "trainable_token_indices": "adapters with trainable tokens (trainable_token_indices) are not supported",
    "layer_replication": "adapters with layer_replication are not supported",
}
# PEFT's LoRA variants, each with its own forward; only plain LoRA and rsLoRA are served.
_VARIANTS = ("alora_invocation_tokens", "arrow_config", "use_bdlora", "kasa_config", "mica", "monteclora_config",
             "use_qalora", "velora_config")


class LoRALoadError(ValueError):
    """The adapter cannot be served; the message says what to fix."""


@dataclass
class LoRAWeights:
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank], already multiplied by the module's scaling

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    name: str
    id: int
    rank: int  # the largest rank over its modules: what a device slot must hold
    scaling: float  # the config's default scaling, for display; each module's is folded into its B
    weights: dict[tuple[int, str], LoRAWeights] = field(repr=False)  # (layer, PEFT module name) -> A, B
    path: Path | None = None

    @property
    def target_modules(self) -> set[str]:
        return {module for _, module in self.weights}

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection an adapter may target."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    hidden, inter = spec.hidden_size, spec.intermediate_size
    if spec.is_moe:  # the MLPs are experts (and a router): adapters on them are refused (_parse_key)
        return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    if spec.fused_checkpoint:
        return {"qkv_proj": (hidden, q + 2 * kv), "o_proj": (q, hidden), "gate_up_proj": (hidden, 2 * inter),
                "down_proj": (inter, hidden)}
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def resolve_adapter_path(path: str | Path, allowed_roots: Sequence[str | Path]) -> Path:
    """The real path of `path` (symlinks resolved) if it lies inside one of `allowed_roots`.

    Containment is checked before existence, so a caller cannot probe for files outside the roots.
    """
    if not allowed_roots:
        raise LoRALoadError("loading adapters by path is disabled: no adapter directories are allowed on this server")
    resolved = Path(path).expanduser().resolve()
    roots = [Path(root).expanduser().resolve() for root in allowed_roots]
    if not any(resolved.is_relative_to(root) for root in roots):
        raise LoRALoadError(f"adapter path {str(path)!r} is outside the allowed adapter directories "
                            f"({', '.join(map(str, roots))})")
    if not resolved.is_dir():
        raise LoRALoadError(f"adapter directory {str(path)!r} does not exist")
    return resolved


def load_adapter(path: str | Path, spec: ModelSpec, max_lora_rank: int, *, lora_id: int, name: str | None = None,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read and validate the PEFT adapter in directory `path` against the base model `spec`."""
    path = Path(path)
    config = _read_config(path)
    raw = _read_weights(path)
    shapes = module_shapes(spec)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, str], str] = {}
    for key, tensor in raw.items():
        layer, module, module_name, ab = _parse_key(key, spec.num_layers, shapes)
        pairs.setdefault((layer, module), {})[ab] = tensor
        names[(layer, module)] = module_name
    if not pairs:
        raise LoRALoadError(f"{path / WEIGHTS_FILE} holds no LoRA weights")
    _check_targets(config, {module for _, module in pairs}, shapes)

    weights: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, module), ab in sorted(pairs.items()):
        where = names[(layer, module)]
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRALoadError(f"adapter {path} has no {missing} weight for {where}")
        rank = _pattern_value(config.get("rank_pattern") or {}, where, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern") or {}, where, config.get("lora_alpha", 8))
        in_features, out_features = shapes[module]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoRALoadError(f"adapter {path} does not fit this base model: {where} has lora_A {tuple(a.shape)} and "
                                f"lora_B {tuple(b.shape)}, expected ({rank}, {in_features}) and ({out_features}, {rank}) "
                                "(was it trained for another model?)")
        if rank > max_lora_rank:
            raise LoRALoadError(f"adapter {path} has rank {rank} at {where}, above max_lora_rank={max_lora_rank}; "
                                f"restart the server with --max-lora-rank {rank} or more")
        scaling = _scaling(alpha, rank, config)
        weights[(layer, module)] = LoRAWeights(a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    return LoRAAdapter(name=name or path.name, id=lora_id, rank=max(w.rank for w in weights.values()),
                       scaling=_scaling(config.get("lora_alpha", 8), config["r"], config), weights=weights, path=path)


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise LoRALoadError(f"adapter directory {str(path)!r} does not exist")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoRALoadError(f"{path} has no {CONFIG_FILE}; expected a PEFT adapter saved with save_pretrained")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoRALoadError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRALoadError(f"{file} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRALoadError(f"{path} is a {config['peft_type']} adapter; only LoRA adapters are supported")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise LoRALoadError(f"{file} needs a positive integer rank 'r', got {config.get('r')!r}")
    if config.get("bias", "none") != "none":
        raise LoRALoadError(f"adapters that train biases (bias={config['bias']!r}) are not supported; "
                            "retrain with bias='none'")
    for key, message in _UNSUPPORTED.items():
        if config.get(key):
            raise LoRALoadError(f"{path}: {message}")
    for key in _VARIANTS:
        if config.get(key):
            raise LoRALoadError(f"{path} is a LoRA variant ({key}), which kubeinfer cannot serve; "
                                "only plain LoRA and rsLoRA adapters are supported")
    return config


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    file = path / WEIGHTS_FILE
    if not file.is_file():
        if any(path.glob("adapter_model*.bin")) or any(path.glob("*.pt")):
            raise LoRALoadError(f"{path} holds only a pickle adapter (adapter_model.bin); kubeinfer loads safetensors "
                                "only, which cannot run code on load. Re-save it with "
                                "peft_model.save_pretrained(dir, safe_serialization=True)")
        raise LoRALoadError(f"{path} has no {WEIGHTS_FILE}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise LoRALoadError(f"cannot read {file}: {exc}") from None


def _parse_key(key: str, num_layers: int, shapes: dict) -> tuple[int, str, str, str]:
    """(layer, module, module's name in the model, "A"/"B") of one saved tensor."""
    match = _KEY.fullmatch(key)
    moe = _MOE_KEY.fullmatch(key)
    if "down_proj" not in shapes and (moe or (match and match.group(3) in ("mlp", "block_sparse_moe"))):
        module = moe.group(1) if moe else match.group(1)
        raise LoRALoadError(f"adapter weight {key!r} targets {module}, an MLP weight (experts, router, shared or "
                            f"dense MLP) of this "
                            f"mixture-of-experts model; kubeinfer serves LoRA on its attention projections only "
                            f"({', '.join(shapes)})")
    if not match:
        raise LoRALoadError(f"unsupported adapter weight {key!r}: kubeinfer serves LoRA on the "
                            f"{', '.join(shapes)} projections of the decoder layers only")
    module_name, layer, parent, module, ab = match.groups()
    if module not in shapes or _PARENT[module] != parent:
        raise LoRALoadError(f"adapter weight {key!r} targets {parent}.{module}, which kubeinfer cannot serve on "
                            f"this base model; supported target modules: {', '.join(shapes)}")
    if int(layer) >= num_layers:
        raise LoRALoadError(f"adapter weight {key!r} is for layer {layer}, but the base model has {num_layers} layers")
    return int(layer), module, module_name, ab


def _check_targets(config: dict, found: set[str], shapes: dict) -> None:
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(shapes))
        if unknown:
            moe = "" if "down_proj" in shapes else " (a mixture of experts: adapters on its experts are refused)"
            raise LoRALoadError(f"adapter targets {', '.join(unknown)}, which kubeinfer cannot serve on this base "
                                f"model{moe}; supported target modules: {', '.join(shapes)}")
        missing = sorted(found - set(targets))
        if missing:
            raise LoRALoadError(f"adapter weights include {', '.join(missing)}, which adapter_config.json's "
                                "target_modules does not list; the adapter is inconsistent")
    # A string is PEFT's "all-linear" or a regex over module names; the saved weights say what it matched.


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's rank_pattern/alpha_pattern lookup: the first pattern matching the end of the module's name."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return value
    return default


def _scaling(alpha: float, rank: int, config: dict) -> float:
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
