"""W8A8 inside the MoE experts: the activation schemes of a checkpoint's per-expert projections
(`experts.E.gate_proj / up_proj / down_proj`, Mixtral's w1 / w3 / w2), gathered per MoE layer and installed on
its stacked experts as one ExpertInputQuant (quantization/expert_input_quant.py), which quantizes the hidden
states before the gate/up product and each (token, expert) intermediate row before the down product.

Served: every expert of a layer with the same scheme per projection (gate/up and down may differ, or one of
them stay float); static scales one per expert (equal or not), gate_proj's and up_proj's equal for each expert
(they read the same input; llm-compressor's observers give them the same scale). Refused by name: experts of
one layer with different schemes, or some with and some without; an expert whose gate_proj and up_proj have
different static scales (the fused gate/up product quantizes its input once); under tensor parallelism, a
rank's slice of the intermediate row that cuts a down_proj activation group."""
from __future__ import annotations

import torch

from .expert_input_quant import ExpertInputQuant
from .activations import ActivationScheme
from .errors import QuantizationError
from .w8a8_tp import whole_token_range

GATE_UP, DOWN = ("gate_proj", "up_proj"), ("down_proj",)


class ExpertSchemes:
    """Collects (projection, expert) -> (scheme, static scale, static zero, checkpoint module) per MoE layer."""

    def __init__(self, model) -> None:
        self.model = model
        self.found: dict[str, dict[tuple[str, int], tuple]] = {}

    def take(self, ours: str, module: str, scheme: ActivationScheme, static) -> bool:
        """Records `ours` (our weight name) when it is an expert's projection; `static()` -> (scale, zero)."""
        expert_of = getattr(self.model, "expert_of", None)
        hit = expert_of(ours) if expert_of is not None else None
        if hit is None:
            return False
        name, expert, projection = hit
        self.found.setdefault(name, {})[(projection, expert)] = (scheme, *static(), module)
        return True

    def at_load(self, scheme: ActivationScheme) -> None:
        """--quantization fp8 on a float checkpoint: every expert of every layer, dynamic (vLLM's online fp8)."""
        for name, moe in getattr(self.model, "experts_modules", dict)().items():
            self.found[name] = {(p, e): (scheme, None, None, f"{name}.{e}.{p}")
                                for e in range(moe.num_experts) for p in GATE_UP + DOWN}

    def install(self) -> dict[str, str]:
        installed = {}
        for name, entries in self.found.items():
            moe = self.model.get_submodule(name)
            gate_up, gate_up_static = _projection(name, moe, entries, GATE_UP)
            down, down_static = _projection(name, moe, entries, DOWN)
            down_range = _check_tensor_parallel(name, moe, down)
            exact = getattr(moe.int_method, "a8", None)  # products that quantize their rows (fused_moe/a8_experts)
            if exact is not None and (gate_up, down) != (exact.scheme, exact.scheme):
                raise QuantizationError(f"{name}: the experts were packed for {exact.scheme.describe()} inputs, "
                                        f"but their checkpoint says {_describe(gate_up, down)}")
            scales = {which: static for which, static in (("gate_up", gate_up_static), ("down", down_static))
                      if static is not None}
            moe.input_quant = ExpertInputQuant(gate_up, down, scales, down_range)
            installed[name] = f"{_describe(gate_up, down)} (fused experts)"
        return installed


def _describe(gate_up: ActivationScheme | None, down: ActivationScheme | None) -> str:
    if gate_up == down:
        return gate_up.describe()
    return ", ".join(f"{which} {'float' if s is None else s.describe()}" for which, s in (("gate/up", gate_up),
                                                                                         ("down", down)))


def _projection(name: str, moe, entries: dict, projections: tuple[str, ...]):
    """(the scheme of these projections in every expert or None, static (scale [E] or [1], zero or None))."""
    present = [entries.get((p, e)) for e in range(moe.num_experts) for p in projections]
    if all(entry is None for entry in present):
        return None, None
    if any(entry is None for entry in present):
        missing = next(f"expert {e} {p}" for e in range(moe.num_experts) for p in projections
                       if (p, e) not in entries)
        raise QuantizationError(f"{name}: some experts' {'/'.join(projections)} quantize their input activations "
                                f"and others' do not ({missing}): mixed experts in one layer are not served")
    schemes = {entry[0] for entry in present}
    if len(schemes) != 1:
        raise QuantizationError(f"{name}: the experts' {'/'.join(projections)} quantize their input differently "
                                f"({', '.join(sorted(s.describe() for s in schemes))}): not served")
    scheme = schemes.pop()
    if scheme.dynamic:
        return scheme, None
    per_expert = []
    for e in range(moe.num_experts):
        parts = [entries[(p, e)] for p in projections]
        first = parts[0]
        for other in parts[1:]:
            if not torch.equal(other[1], first[1]) or (first[2] is not None and not torch.equal(other[2], first[2])):
                raise QuantizationError(f"{first[3]} and {other[3]} have different static input scales: the fused "
                                        "gate/up product quantizes its input once per expert, so this is not served")
        per_expert.append(first)
    weight = moe.gate_up_proj  # its device: where the stacks go when kept experts left them on meta (layer.py)
    device = getattr(moe, "stack_device", weight.device)
    scale = torch.cat([entry[1] for entry in per_expert]).to(device, weight.dtype)  # the model dtype, as
    zero = None if scheme.symmetric else torch.cat([entry[2] for entry in per_expert]).to(device)  # w8a8
    if bool((scale == scale[0]).all()) and (zero is None or bool((zero == zero[0]).all())):
        scale, zero = scale[:1], None if zero is None else zero[:1]  # one scale: the tokens quantized once
    return scheme, (scale, zero)


def _check_tensor_parallel(name: str, moe, down: ActivationScheme | None):
    """A rank holds I / tp columns of each expert's intermediate row (gate/up read the whole hidden state):
    a per-token down_proj scale takes the whole row's range (w8a8_tp.whole_token_range: every rank holds the
    same (token, expert) rows in the same order, so one MAX all-reduce pairs them); groups must tile the
    rank's slice. Returns the down input's `reduce_range` (None: exact locally)."""
    if moe.tp_size == 1 or down is None or not down.dynamic:
        return None
    if down.strategy == "token":
        return whole_token_range
    if down.strategy == "group" and moe.intermediate_size % down.group_size == 0:
        return None
    raise QuantizationError(f"{name}: with tensor_parallel_size {moe.tp_size} each rank holds "
                            f"{moe.intermediate_size} of the experts' intermediate columns, which cut a group of "
                            f"{down.group_size} activation columns ({down.describe()}); serve it with a "
                            f"tensor_parallel_size whose slices are multiples of {down.group_size} "
                            "(or tensor_parallel_size 1)")
