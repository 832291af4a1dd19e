"""The experts of one MoE layer on the CPU (and the reference the fused kernel is checked against): the
(token, choice) pairs sorted by expert, each active expert's tokens gathered into one block and run through
its two matmuls at once, the results weighted and summed back per token. The only Python loop is over the
experts that received tokens, never over tokens."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor],
                    gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; topk_weights, topk_ids [T, k]; activation: [n, 2I] -> [n, I].
    Returns [T, H]: sum over each token's k experts of weight * expert(x)."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order inside a group
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tokens = order // top_k
    gathered = x.index_select(0, tokens)
    out = torch.empty_like(gathered)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        h = F.linear(gathered[rows], gate_up[expert], None if gate_up_bias is None else gate_up_bias[expert])
        out[rows] = F.linear(activation(h), down[expert], None if down_bias is None else down_bias[expert])
        start += count
    out.mul_(topk_weights.reshape(-1)[order].unsqueeze(1).to(out.dtype))
    # Added back in expert order per token: the order transformers' eager experts add them in.
    return torch.zeros_like(x).index_add_(0, tokens, out)
