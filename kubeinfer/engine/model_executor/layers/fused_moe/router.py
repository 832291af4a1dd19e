"""Which experts each token goes to, and with what weight: the routers of the served MoE families.

  * softmax then top-k (Qwen2-MoE, Qwen3-MoE; Mixtral always renormalises the k weights to sum to one,
    the Qwen models when the config's `norm_topk_prob` says so);
  * top-k of the logits then softmax over those k (gpt-oss, whose router has a bias).
Weights are computed in fp32 and returned in the logits' dtype, as transformers' routers do.
"""
from __future__ import annotations

import torch


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k], expert ids [T, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss: the k largest logits, softmaxed among themselves (in the logits' dtype, as its reference)."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), ids
