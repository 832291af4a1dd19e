"""Granite (`GraniteForCausalLM`): the Llama decoder with four multipliers from the config: embeddings times
`embedding_multiplier`, each attention and MLP output times `residual_multiplier` before it joins the
residual stream, attention scores scaled by `attention_multiplier` (not head_dim ** -0.5), and logits divided
by `logits_scaling`."""
from __future__ import annotations

import torch

from ...config import ModelSpec
from ..layers.rotary_embedding import RotaryEmbedding
from .llama import Attention, CausalLM, DecoderLayer


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, spec: ModelSpec, backend, rotary: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__(spec, backend, rotary, layer_idx)
        self.self_attn = Attention(spec, backend, rotary, layer_idx, scale=spec.config.attention_multiplier)
        self.residual_multiplier = spec.config.residual_multiplier

    def forward(self, x, residual, positions, kv_cache, meta, lora=None):
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, kv_cache, meta, lora) * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, lora) * self.residual_multiplier, residual


class GraniteForCausalLM(CausalLM):
    layer_class = GraniteDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.spec.config.embedding_multiplier

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lm_head(x) / self.spec.config.logits_scaling).float()
