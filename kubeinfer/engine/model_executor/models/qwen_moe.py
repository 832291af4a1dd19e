"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 decoders (Qwen3's per-head q/k norms) whose sparse layers route
each token to `num_experts_per_tok` of `num_experts` experts by a softmax router (the k weights renormalised
when `norm_topk_prob`); the other layers are dense (`mlp_only_layers`, `decoder_sparse_step`). Qwen2-MoE adds a
shared expert every token goes through, scaled by a sigmoid gate."""
from __future__ import annotations

from .moe import MoECausalLM, MoESettings, sparse_layers


class Qwen3MoeForCausalLM(MoECausalLM):
    @staticmethod
    def moe_settings(config) -> MoESettings:
        return MoESettings(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                           intermediate_size=config.moe_intermediate_size,
                           renormalize=bool(getattr(config, "norm_topk_prob", False)),
                           shared_expert_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
                           sparse_layers=sparse_layers(config))


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """The same block with its shared expert (`shared_expert_intermediate_size`); no q/k norms."""
