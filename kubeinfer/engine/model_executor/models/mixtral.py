"""Mixtral: the Mistral decoder with every MLP a sparse block of `num_local_experts` experts, top-k of a softmax
router always renormalised. Checkpoints name the block `block_sparse_moe` and the experts' projections w1
(gate), w3 (up), w2 (down); the loader stacks them (models/moe.py)."""
from __future__ import annotations

from .moe import MoECausalLM, MoESettings


class MixtralForCausalLM(MoECausalLM):
    @staticmethod
    def moe_settings(config) -> MoESettings:
        return MoESettings(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                           intermediate_size=config.intermediate_size, renormalize=True)

    @staticmethod
    def checkpoint_name(key: str) -> str | None:
        return key.replace(".block_sparse_moe.", ".mlp.")
