"""An adapter's slice for one tensor-parallel rank, cut like the projection it modifies: B of a
column-parallel projection (q, k, v, gate, up, and the fused qkv_proj / gate_up_proj) keeps the rank's
output rows, part by part; A of a row-parallel one (o_proj, down_proj) keeps the rank's input columns,
so its delta is a partial sum that joins the projection's own before the all-reduce."""
from __future__ import annotations

import torch

from ..config import ModelSpec, Part
from .adapter import LoRAWeights


def output_parts(spec: ModelSpec, module: str) -> list[Part] | None:
    """The rank's parts of a column-parallel module's output; None for a row-parallel module."""
    q, k, v = spec.qkv_parts()
    gate, up = spec.gate_up_parts()
    return {"q_proj": [q], "k_proj": [k], "v_proj": [v], "gate_proj": [gate], "up_proj": [up],
            "qkv_proj": [q, k, v], "gate_up_proj": [gate, up]}.get(module)


def rank_slice(weights: LoRAWeights, module: str, spec: ModelSpec) -> LoRAWeights:
    """`weights` (the whole adapter module) cut to what rank `spec.tp_rank` of `spec.tp_size` holds."""
    if spec.tp_size == 1:
        return weights
    parts = output_parts(spec, module)
    if parts is None:  # o_proj, down_proj: input columns, the heads or MLP columns this rank computed
        start = spec.tp_rank * (spec.num_heads * spec.head_dim if module == "o_proj" else spec.intermediate_size)
        width = spec.num_heads * spec.head_dim if module == "o_proj" else spec.intermediate_size
        return LoRAWeights(weights.a[:, start:start + width].contiguous(), weights.b)
    rows, offset = [], 0
    for part in parts:
        rows.append(weights.b[offset + part.start:offset + part.start + part.size])
        offset += part.total
    return LoRAWeights(weights.a, torch.cat(rows).contiguous())
