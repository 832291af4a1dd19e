"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's switches, read from the config.

RMSNorm scales by (1 + w) in fp32; embeddings are multiplied by sqrt(hidden_size); each layer norms the
attention and MLP outputs as well as their inputs (four norms); the MLP is GeGLU (`hidden_activation`);
scores are scaled by query_pre_attn_scalar ** -0.5. Layers follow `layer_types`: "sliding_attention" layers
see the last `sliding_window` tokens, the others all. Gemma 2 caps attention scores and final logits with
tanh (attn_logit_softcapping, final_logit_softcapping); Gemma 3 norms q and k per head and gives its local
(sliding) layers their own RoPE base.
"""
from __future__ import annotations

import torch
from torch import nn

from ...config import ModelSpec, rope_settings
from ..layers.layernorm import RMSNorm
from ..layers.rotary_embedding import RotaryEmbedding
from .llama import MLP, Attention, CausalLM


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w), computed in fp32 and rounded once at the end, as Gemma's reference does."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GemmaDecoderLayer(nn.Module):
    gemma3 = False

    def __init__(self, spec: ModelSpec, backend, rotary: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__()
        config = spec.config
        softcap = None if self.gemma3 else getattr(config, "attn_logit_softcapping", None)
        self.self_attn = Attention(spec, backend, rotary, layer_idx, qk_norm=self.gemma3, norm=GemmaRMSNorm,
                                   scale=config.query_pre_attn_scalar ** -0.5, softcap=softcap)
        self.mlp = MLP(spec, layer_idx)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps))

    def forward(self, x, residual, positions, kv_cache, meta, lora=None):
        """As the Llama layer's: returns (output, residual), the next layer's input being their sum."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, kv_cache, meta, lora))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h, lora)), residual


class Gemma3DecoderLayer(GemmaDecoderLayer):
    gemma3 = True


class Gemma2ForCausalLM(CausalLM):
    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, spec: ModelSpec, backend, max_positions: int) -> None:
        super().__init__(spec, backend, max_positions)
        self.final_softcap = getattr(spec.config, "final_logit_softcapping", None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the model's dtype first, as the reference multiplies by it; a Python number,
        # so that a CUDA graph captures no host tensor.
        return x * float(torch.tensor(self.spec.hidden_size ** 0.5, dtype=x.dtype, device="cpu"))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(x)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    def use_triton_kernels(self) -> None:
        """Gemma's (1 + w) norms stay in torch; the rotary kernel applies."""
        for rotary in self.model.rotaries:
            rotary.fused = True


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_class = Gemma3DecoderLayer

    @staticmethod
    def make_rotaries(spec: ModelSpec, max_positions: int) -> list[RotaryEmbedding]:
        """Local (sliding) layers and global layers each have their own RoPE parameters."""
        params = dict(getattr(spec.config, "rope_parameters", None) or {})
        rotaries = {}
        for layer_type in ("sliding_attention", "full_attention"):
            if isinstance(params.get(layer_type), dict):
                theta, scaling = _settings(params[layer_type])
            else:  # a flat (transformers 4) config: rope_theta for the global layers, rope_local_base_freq locally
                theta, scaling = rope_settings(spec.config)
                if layer_type == "sliding_attention":
                    theta, scaling = float(getattr(spec.config, "rope_local_base_freq", 10_000.0)), {}
            rotaries[layer_type] = RotaryEmbedding(spec.head_dim, max_positions, theta, scaling)
        return [rotaries["full_attention" if w is None else "sliding_attention"] for w in spec.layer_windows]


class Gemma3TextOnly(Gemma3ForCausalLM):
    """A `Gemma3ForConditionalGeneration` checkpoint served as text: its language model, the vision tower and
    projector left unread. Names are either transformers 5's (model.language_model.*) or the Hub's older
    ones (language_model.model.*, language_model.lm_head.*)."""

    @staticmethod
    def checkpoint_name(key: str) -> str | None:
        for theirs, ours in (("model.language_model.", "model."), ("language_model.model.", "model."),
                             ("language_model.lm_head.", "lm_head.")):
            if key.startswith(theirs):
                return ours + key[len(theirs):]
        if key.startswith("lm_head."):
            return key
        return None  # vision_tower.*, multi_modal_projector.*


def _settings(params: dict) -> tuple[float, dict]:
    scaling = dict(params)
    theta = float(scaling.pop("rope_theta", 10_000.0))
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    return theta, scaling
