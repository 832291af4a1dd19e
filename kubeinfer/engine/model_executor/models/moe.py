"""What the mixture-of-experts families share: the sparse block (router, stacked experts, an optional shared
expert with its sigmoid gate), the decoder layer that holds it in place of the dense MLP on its sparse
layers, and the loading of expert weights into the stacked tensors from either checkpoint layout: one tensor
per expert and projection (the Hub's: `experts.{e}.gate_proj.weight`, Mixtral's `experts.{e}.w1.weight`) or
already stacked (`experts.gate_up_proj`, as transformers 5 keeps them in memory).

The families (qwen_moe.py, mixtral.py, gpt_oss.py) say how their config names these with `MoESettings`.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelSpec, Part
from ...distributed.parallel_state import all_reduce
from ..layers import deferred_weight
from ..layers.fused_moe.layer import FusedMoE
from ..layers.fused_moe.router import softmax_topk, topk_softmax
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from .llama import MLP, CausalLM, DecoderLayer

# Per-expert checkpoint tensors: (the experts' module, expert, projection). w1/w3/w2 are Mixtral's gate/up/down.
_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?")
_SHARED = re.compile(r"(model\.layers\.\d+\.mlp\.shared_expert)\.(gate_proj|up_proj)\.weight")
_PROJECTION = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass(frozen=True)
class MoESettings:
    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    router: str = "softmax_topk"  # or "topk_softmax" (gpt-oss)
    renormalize: bool = False  # the k weights rescaled to sum to one (Mixtral always; Qwen by norm_topk_prob)
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU
    swiglu_alpha: float = 1.702
    shared_expert_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    sparse_layers: tuple[int, ...] | None = None  # None: every layer


class SharedExpert(nn.Module):
    """Qwen2-MoE's dense expert every token also goes through, scaled by sigmoid(gate(x)). Under tensor
    parallelism split like a dense MLP (gate/up by column, down by row); its output is this rank's partial sum,
    which the sparse block adds to the experts' before the one all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"the model's shared_expert_intermediate_size ({intermediate_size}) is not divisible by "
                             f"the tensor parallel size ({tp_size})")
        local = intermediate_size // tp_size
        self.intermediate_size, self.tp_size = local, tp_size
        part = Part(intermediate_size, tp_rank * local, local)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [part, part], bias=False)
        self.down_proj = RowParallelLinear(part, hidden_size, bias=False, tp_size=tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (the whole output in a group of one)."""
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        h = F.silu(gate) * up
        return self.down_proj(h) if self.tp_size == 1 else self.down_proj.partial(h)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, settings: MoESettings, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.settings, self.tp_size = settings, tp_size
        # the router is replicated: every rank routes every token alike, to its slice of each chosen expert
        self.gate = nn.Linear(hidden_size, settings.num_experts, bias=settings.router_bias)
        self.experts = FusedMoE(settings.num_experts, hidden_size, settings.intermediate_size,
                                bias=settings.expert_bias, swiglu_limit=settings.swiglu_limit,
                                swiglu_alpha=settings.swiglu_alpha, tp_rank=tp_rank, tp_size=tp_size)
        if settings.shared_expert_size:
            self.shared_expert = SharedExpert(hidden_size, settings.shared_expert_size, tp_rank, tp_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """x [T, H] -> [T, H]; adapters never apply here (refused at load: lora/adapter.py)."""
        logits = self.gate(x)
        s = self.settings
        if s.router == "topk_softmax":
            weights, ids = topk_softmax(logits, s.top_k)
        else:
            weights, ids = softmax_topk(logits, s.top_k, s.renormalize)
        out = self.experts(x, weights, ids)  # under TP: this rank's slice of every expert, a partial sum
        if s.shared_expert_size:  # a per-token scale of a partial sum is the partial of the scaled sum
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp_size == 1 else all_reduce(out)  # once per layer, experts and shared expert together


class DenseMLP(MLP):
    """A dense layer of an MoE model: adapters target the attention projections only (lora/adapter.py)."""

    def forward(self, x, lora=None):
        return super().forward(x, None)


class MoEDecoderLayer(DecoderLayer):
    """The Llama layer with the sparse block in place of the MLP on the model's sparse layers."""

    def __init__(self, spec: ModelSpec, backend, rotary, layer_idx: int) -> None:
        super().__init__(spec, backend, rotary, layer_idx)
        settings: MoESettings = spec.moe
        if settings.sparse_layers is None or layer_idx in settings.sparse_layers:
            self.mlp = SparseMoeBlock(spec.hidden_size, settings, spec.tp_rank, spec.tp_size)
        else:
            self.mlp = DenseMLP(spec, layer_idx)


class MoECausalLM(CausalLM):
    """A CausalLM whose sparse layers hold stacked experts; subclasses give `moe_settings(config)`."""
    layer_class = MoEDecoderLayer
    expert_weight_transform = None  # set by transform_expert_weights

    def __init__(self, spec: ModelSpec, backend, max_positions: int) -> None:
        spec.moe = self.moe_settings(spec.config)
        super().__init__(spec, backend, max_positions)

    @staticmethod
    def moe_settings(config) -> MoESettings:
        raise NotImplementedError

    def experts_modules(self) -> dict[str, FusedMoE]:
        return {name: m for name, m in self.named_modules() if isinstance(m, FusedMoE)}

    def router_names(self) -> set[str]:
        """The routers' linear layers (and Qwen2-MoE's shared-expert gate): float under --quantization fp8."""
        return {f"{name}.{part}" for name, m in self.named_modules() if isinstance(m, SparseMoeBlock)
                for part in ("gate", "shared_expert_gate") if hasattr(m, part)}

    def transform_expert_weights(self, transform: Callable[[torch.Tensor, str], torch.Tensor]) -> None:
        """Every expert's and shared expert's full weight [.., out, in] mapped before it is stored (the loader's
        --quantization fp8 on a float checkpoint)."""
        self.expert_weight_transform = transform
        for moe in self.experts_modules().values():
            moe.weight_transform = transform

    def expert_of(self, name: str) -> tuple[str, int, str] | None:
        """(experts module, expert, gate_proj | up_proj | down_proj) of a per-expert weight's name (ours), else
        None (layers/quantization/w8a8_experts.py)."""
        if match := _PER_EXPERT.fullmatch(name):
            return match.group(1), int(match.group(2)), _PROJECTION.get(match.group(3), match.group(3))
        return None

    def expected_loads(self) -> dict[str, int]:
        """Slices each stacked parameter needs: one per expert and projection (a stacked tensor counts for all)."""
        counts = {}
        for name, moe in self.experts_modules().items():
            counts[f"{name}.gate_up_proj"] = counts[f"{name}.gate_up_proj_bias"] = 2 * moe.num_experts
            counts[f"{name}.down_proj"] = counts[f"{name}.down_proj_bias"] = moe.num_experts
        return counts

    def load_special_weight(self, name: str, key: str, read: Callable[[str], torch.Tensor | None]) -> dict | None:
        """Load checkpoint tensor `key` (our name `name`) when it is an expert or shared-expert weight; returns
        {parameter: slices filled}, or None to leave the tensor to the common loader."""
        if match := _PER_EXPERT.fullmatch(name):
            module, expert, projection = match.group(1), int(match.group(2)), match.group(3)
            moe = self._experts(module, name)
            projection = _PROJECTION.get(projection, projection)
            tensor = read(key)
            if projection == "down_proj":
                moe.load_down(expert, tensor)
                return {f"{module}.down_proj": 1}
            moe.load_gate_or_up(projection.removesuffix("_proj"), expert, tensor)
            return {f"{module}.gate_up_proj": 1}
        if match := _STACKED.fullmatch(name):
            return self.load_stacked(match.group(1), match.group(2), bool(match.group(3)), read(key))
        if match := _SHARED.fullmatch(name):  # the shared expert's own intermediate size, not the config's
            linear = self.get_submodule(match.group(1)).gate_up_proj
            deferred_weight.allocated(linear)  # written in float here (a deferred float weight allocated)
            tensor, part = read(key), linear.parts[0]
            if tuple(tensor.shape) != (part.total, linear.in_features):
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, the config implies "
                                 f"{(part.total, linear.in_features)}")
            if self.expert_weight_transform is not None:
                tensor = self.expert_weight_transform(tensor, name)
            for target, piece in linear.weight_pieces(linear.weight, tensor, 0 if match.group(2) == "gate_proj" else 1):
                _fill(target, piece, name)  # this rank's rows of gate or of up
            return {f"{match.group(1)}.gate_up_proj.weight": 1}
        return None

    def load_stacked(self, module: str, projection: str, bias: bool, tensor: torch.Tensor) -> dict:
        """An [E, ...] tensor of every expert in our layout ([E, 2I, H] gate then up; [E, H, I])."""
        moe = self._experts(module, f"{module}.{projection}")
        suffix = "_bias" if bias else ""
        if projection == "down_proj":
            moe.load_down(None, tensor, bias=bias)
            return {f"{module}.down_proj{suffix}": moe.num_experts}
        moe.load_gate_up(None, tensor, bias=bias)
        return {f"{module}.gate_up_proj{suffix}": 2 * moe.num_experts}

    def _experts(self, module: str, name: str) -> FusedMoE:
        try:
            moe = self.get_submodule(module)
        except AttributeError:
            moe = None
        if not isinstance(moe, FusedMoE):
            raise ValueError(f"unexpected expert weight {name!r}: that layer is dense in this config "
                             "(mlp_only_layers / decoder_sparse_step), the checkpoint does not match it")
        return moe

    def use_triton_kernels(self) -> None:
        super().use_triton_kernels()
        for moe in self.experts_modules().values():
            moe.fused = True


def _fill(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, the config implies {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)


def sparse_layers(config) -> tuple[int, ...]:
    """Qwen's rule: layer i is sparse unless listed in mlp_only_layers, and when (i + 1) % decoder_sparse_step == 0."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return tuple(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
