"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): the Llama decoder with q/k/v and gate/up already fused in the
checkpoint (`qkv_proj`, `gate_up_proj`, loaded as they are), RoPE on the first `partial_rotary_factor` of
each head only, and LongRoPE scaling (`rope_type: longrope`, its short and long factors).

LongRoPE picks one set of factors for the whole model: the long factors when the served context
(max_model_len) is longer than `original_max_position_embeddings`, else the short ones, as llama.cpp does
for its context size. Every token of every request is then rotated alike, so cached blocks stay valid
for any later request. (transformers switches per forward pass, by the longest sequence in it: that
agrees with this whenever all of a batch's sequences are on the same side of the original length.)
"""
from __future__ import annotations

import torch

from ...config import ModelSpec
from ..layers.rotary_embedding import RotaryEmbedding
from .llama import Attention, CausalLM, DecoderLayer, _project


def rotary_dim(spec: ModelSpec) -> int:
    factor = spec.rope_scaling.get("partial_rotary_factor", getattr(spec.config, "partial_rotary_factor", 1.0))
    return int(spec.head_dim * factor)


class Phi3Attention(Attention):
    def __init__(self, spec: ModelSpec, backend, rotary: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__(spec, backend, rotary, layer_idx)
        self.rotary_dim = rotary_dim(spec)

    def forward(self, x, positions, kv_cache, meta, lora=None):
        if self.rotary_dim == self.head_dim:
            return super().forward(x, positions, kv_cache, meta, lora)
        qkv = _project(self.qkv_proj, x, lora, self.layer_idx, "qkv_proj")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        d = self.rotary_dim  # the rest of each head passes through unrotated
        q = torch.cat((self.rotary.rotate(positions, q[..., :d]), q[..., d:]), dim=-1)
        k = torch.cat((self.rotary.rotate(positions, k[..., :d]), k[..., d:]), dim=-1)
        return self._attend(q, k, v, kv_cache, meta, lora)


class Phi3DecoderLayer(DecoderLayer):
    def __init__(self, spec: ModelSpec, backend, rotary: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__(spec, backend, rotary, layer_idx)
        self.self_attn = Phi3Attention(spec, backend, rotary, layer_idx)


class Phi3ForCausalLM(CausalLM):
    layer_class = Phi3DecoderLayer
    checkpoint_fused = True

    @staticmethod
    def make_rotaries(spec: ModelSpec, max_positions: int) -> list[RotaryEmbedding]:
        scaling = dict(spec.rope_scaling)
        scaling.pop("partial_rotary_factor", None)
        if scaling.get("rope_type") in ("longrope", "su"):  # "su": LongRoPE's first name in Phi-3 configs
            scaling["rope_type"] = "longrope"
            scaling.setdefault("original_max_position_embeddings", spec.config.original_max_position_embeddings)
            scaling.setdefault("max_position_embeddings", spec.max_position_embeddings)
        return [RotaryEmbedding(rotary_dim(spec), max_positions, spec.rope_theta, scaling)] * spec.num_layers

    def use_triton_kernels(self) -> None:
        """The fused norms; the rotary kernel only where it covers whole heads."""
        super().use_triton_kernels()
        self.model.rotary.fused = rotary_dim(self.spec) == self.spec.head_dim
