"""OLMo 2 (`Olmo2ForCausalLM`): the Llama decoder with its norms after attention and after the MLP instead of
before them (x + norm(attn(x)), then x + norm(mlp(x))), and RMSNorms on q and k over the whole projection
(all heads at once), before RoPE."""
from __future__ import annotations

import torch
from torch import nn

from ...config import ModelSpec, Part
from ...distributed.parallel_state import all_reduce
from ..layers.layernorm import RMSNorm
from ..layers.rotary_embedding import RotaryEmbedding
from .llama import MLP, Attention, CausalLM, _project


class Olmo2RMSNorm(RMSNorm):
    """As RMSNorm, but in half precision the weight multiplies before rounding, as OLMo's reference does."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super()._norm(x)
        xf = x.float()
        return (self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class Olmo2ProjectionNorm(Olmo2RMSNorm):
    """The norm of a whole q or k projection, of which a tensor-parallel rank holds `part`: the mean square is
    the mean over ranks of each rank's (a KV head replicated on r ranks counts r times, as it is r times
    in the sum too), so one all-reduce of a [tokens, 1] column makes it the whole projection's."""

    def __init__(self, part: Part, eps: float, tp_size: int) -> None:
        super().__init__(part.size, eps)
        self.part, self.tp_size = part, tp_size

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super()._norm(x)
        xf = x.float()
        mean_square = all_reduce(xf.pow(2).mean(-1, keepdim=True)) / self.tp_size
        out = xf * torch.rsqrt(mean_square + self.eps)
        return out.to(x.dtype) * self.weight if x.dtype == torch.float32 else (self.weight * out).to(x.dtype)

    def weight_pieces(self, param: torch.Tensor, source, shard: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(param, source.narrow(0, self.part.start, self.part.size))]


class Olmo2Attention(Attention):
    def __init__(self, spec: ModelSpec, backend, rotary: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__(spec, backend, rotary, layer_idx, qk_norm=False)
        q, k, _ = spec.qkv_parts()
        self.q_norm = Olmo2ProjectionNorm(q, spec.rms_norm_eps, spec.tp_size)
        self.k_norm = Olmo2ProjectionNorm(k, spec.rms_norm_eps, spec.tp_size)

    def forward(self, x, positions, kv_cache, meta, lora=None):
        qkv = _project(self.qkv_proj, x, lora, self.layer_idx, "qkv_proj")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(k).view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self._attend(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim), kv_cache, meta, lora)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend, rotary: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(spec, backend, rotary, layer_idx)
        self.post_attention_layernorm = Olmo2RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, layer_idx)
        self.post_feedforward_layernorm = Olmo2RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, residual, positions, kv_cache, meta, lora=None):
        """As the Llama layer's: (output, residual), the next layer's input being their sum."""
        s = x if residual is None else x + residual
        s = s + self.post_attention_layernorm(self.self_attn(s, positions, kv_cache, meta, lora))
        return self.post_feedforward_layernorm(self.mlp(s, lora)), s


class Olmo2ForCausalLM(CausalLM):
    layer_class = Olmo2DecoderLayer
    norm_class = Olmo2RMSNorm

    def use_triton_kernels(self) -> None:
        """The final norm (with its residual add) and the rotary kernel; the per-layer norms stay in torch."""
        self.model.norm.fused = True
        self.model.rotary.fused = True
