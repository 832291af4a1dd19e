"""The loader's side of kept-quantized MoE experts (layers/fused_moe/int_experts.py): each per-expert checkpoint
weight (`experts.E.gate_proj`, Mixtral's `w1`, ...) read as the format's integers and scales (`int_weight`,
no dequantization), collected per MoE layer, then installed on the layer once the loop has read every shard:
this rank's slice of each expert (gate/up: its rows of the intermediate dimension, down: its columns; a cut
inside a quantization group regrouped exactly by IntWeight.narrow), stacked for the chosen kernel, as soon as
the layer's last expert weight is read (one layer's integers in transit at a time). A layer the
kernel choice does not keep (or one where some expert's weight has no integer form, e.g. GPTQ act-order) is
dequantized into the float stacks through FusedMoE's own loaders, as before.

`--quantization fp8` on a float checkpoint (the format's `int_weight` quantizes each float expert weight per
output row to e4m3 as it is read, fp8.quantize_per_channel: the bits of the float path's round trip) comes
through here too where a kept fp8 kernel exists (CUDA, or the forced Triton kernel): the layer's experts stay
e4m3 with one float32 scale per row and the float stacks are never allocated; a layer that falls back is
dequantized into them, the round trip's very values, not round-tripped again."""
from __future__ import annotations

import torch

from .checkpoint_shapes import check_experts
from .layers.fused_moe.int_experts import ExpertsIntMethod, choose_expert_kernel, stack
from .layers.quantization.linear_method import IntWeight

GATE_UP = ("gate_proj", "up_proj")


class ExpertIntegers:
    """Collects {experts module: {(projection, expert): IntWeight}} while the loader reads the checkpoint;
    `w8a8`: the checkpoint quantizes activations (linear_method.choose_kernel)."""

    def __init__(self, model, quantization, get, device: torch.device, dtype: torch.dtype, w8a8: bool) -> None:
        self.model, self.quantization, self.get = model, quantization, get
        self.device, self.dtype, self.w8a8 = device, dtype, w8a8
        self.found: dict[str, dict[tuple[str, int], IntWeight]] = {}
        self.inputs: dict[str, set] = {}  # {experts module: its experts' input activation schemes} (W8A8)
        self.chosen: dict[str, str] = {}  # {experts module: kernel}, the start-up log's

    def take(self, ours: str, key: str, f) -> dict | None:
        """{stacked parameter: 1} when `key` is a per-expert weight the format gives as integers, else None
        (the model's own loader reads it as float)."""
        hit = self.model.expert_of(ours)
        if hit is None:
            return None
        module, expert, projection = hit
        weight = self.quantization.int_weight(key, f.get_tensor(key), self.get)
        if weight is None or weight.values.dim() != 2:
            return None
        check_experts(module, self.model.get_submodule(module), projection, key, weight)  # before any stacking
        weights = self.found.setdefault(module, {})
        weights[(projection, expert)] = weight
        scheme_of = getattr(self.quantization, "input_activations", None) if self.w8a8 else None
        self.inputs.setdefault(module, set()).add(scheme_of(key.rsplit(".", 1)[0]) if scheme_of else None)
        if len(weights) == 3 * self.model.get_submodule(module).num_experts:
            self._install(module, self.found.pop(module))
        return {f"{module}.{'down_proj' if projection == 'down_proj' else 'gate_up_proj'}": 1}

    def install(self) -> dict[str, str]:
        """The layers not complete as integers (some expert read as float) dequantized; returns {module: kernel}."""
        for name in list(self.found):
            self._install(name, self.found.pop(name))
        return self.chosen

    def _install(self, name: str, weights: dict) -> None:
        moe = self.model.get_submodule(name)
        kept = _rank_slices(moe, weights) if len(weights) == 3 * moe.num_experts else None
        kernel = "dequantized"
        inputs = self.inputs.pop(name, set())
        inputs = inputs.pop() if len(inputs) == 1 else None  # mixed: w8a8_experts refuses them by name
        if kept is not None:
            kernels = {choose_expert_kernel(kept[which][0], self.device, self.dtype, self.w8a8, inputs)
                       for which in kept}
            kernel = kernels.pop() if len(kernels) == 1 else "dequantized"
        fp8 = next(iter(weights.values())).fp8
        if kernel == "dequantized":
            _dequantize_into(moe, weights)
        else:
            weights.clear()  # each part now lives in `kept` alone, and each projection's once stacked
            stacked = {w: stack(kept.pop(w)) for w in list(kept)}
            moe.int_method = ExpertsIntMethod(moe, stacked, kernel, self.dtype, self.device)
        self.chosen[name] = f"{kernel}_fp8" if fp8 and kernel != "dequantized" else kernel


def _rank_slices(moe, weights: dict) -> dict[str, list[IntWeight]] | None:
    """Per projection, every expert's IntWeight cut to this rank's slice (gate rows then up rows; down columns)."""
    inter, start = moe.intermediate_size, moe.tp_rank * moe.intermediate_size
    cut = (lambda w, dim: w) if moe.tp_size == 1 else (lambda w, dim: w.narrow(dim, start, inter))
    gate_up, down = [], []
    for e in range(moe.num_experts):
        parts = [weights[(p, e)] for p in GATE_UP]
        if any(p.values.shape[0] != inter * moe.tp_size for p in parts):
            return None  # the model's loaders name the shape mismatch
        try:
            gate_up.append(IntWeight.cat([cut(p, 0) for p in parts]))
        except ValueError:
            return None  # gate and up quantized differently: dequantized
        down.append(cut(weights[("down_proj", e)], 1))
    return {"gate_up": gate_up, "down": down}


def _dequantize_into(moe, weights: dict) -> None:
    """Each expert's weight dequantized into the float stacks; the layer's `weight_transform` (the float path's
    fp8 round trip) is not applied again: these values already are its result."""
    transform, moe.weight_transform = moe.weight_transform, None
    try:
        for (projection, expert), weight in weights.items():
            tensor = weight.dequantize()
            if projection == "down_proj":
                moe.load_down(expert, tensor)
            else:
                moe.load_gate_or_up(projection.removesuffix("_proj"), expert, tensor)
    finally:
        moe.weight_transform = transform
