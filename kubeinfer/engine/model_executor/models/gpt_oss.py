"""gpt-oss: a decoder of alternating sliding-window and full-attention layers (`layer_types`), biases on
q/k/v/o, an attention sink per head (a learned logit in the softmax's denominator), YaRN rotary scaling, and
in every layer a sparse block: a router with a bias whose top-k logits are softmaxed among themselves, experts
with biases and a clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 gate), gate <= limit, |up| <= limit).

Checkpoints keep the experts stacked in transformers' [E, in, out] orientation with gate and up interleaved
(column 2j gate, 2j + 1 up); the MXFP4 ones as `*_blocks` / `*_scales` in [E, out, in]. Both load into the
layer's [E, 2I, H] gate-then-up and [E, H, I] (the MXFP4 ones dequantized: layers/quantization/mxfp4.py).
"""
from __future__ import annotations

import torch
from torch import nn

from ...config import ModelSpec
from ..layers.layernorm import RMSNorm
from ..layers.quantization import mxfp4
from .llama import Attention, _project
from .moe import MoECausalLM, MoEDecoderLayer, MoESettings


class GptOssRMSNorm(RMSNorm):
    """The weight multiplies in fp32 before rounding (transformers keeps gpt-oss's norms in fp32)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class SinkAttention(Attention):
    def __init__(self, spec: ModelSpec, backend, rotary, layer_idx: int) -> None:
        super().__init__(spec, backend, rotary, layer_idx)
        self.sinks = nn.Parameter(torch.empty(spec.num_heads), requires_grad=False)  # this rank's heads
        self.first_head, self.total_heads = spec.tp_rank * spec.num_heads, spec.total_heads

    def weight_pieces(self, param: torch.Tensor, source, shard: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The loader's hook for the sinks (this module's one parameter): one logit per head, cut like the heads."""
        if tuple(source.shape) != (self.total_heads,):
            raise ValueError(f"attention sinks have shape {tuple(source.shape)}, the config implies "
                             f"({self.total_heads},)")
        return [(param, source.narrow(0, self.first_head, self.num_heads))]

    def _attend(self, q, k, v, kv_cache, meta, lora):
        if self.window != meta.sliding_window:
            meta = meta.for_window(self.window)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, sinks=self.sinks)
        return _project(self.o_proj, out.reshape(-1, self.q_size), lora, self.layer_idx, "o_proj")


class GptOssDecoderLayer(MoEDecoderLayer):
    def __init__(self, spec: ModelSpec, backend, rotary, layer_idx: int) -> None:
        super().__init__(spec, backend, rotary, layer_idx)
        self.self_attn = SinkAttention(spec, backend, rotary, layer_idx)
        self.input_layernorm = GptOssRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(spec.hidden_size, spec.rms_norm_eps)


class GptOssForCausalLM(MoECausalLM):
    layer_class = GptOssDecoderLayer
    norm_class = GptOssRMSNorm

    @staticmethod
    def moe_settings(config) -> MoESettings:
        return MoESettings(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                           intermediate_size=config.intermediate_size, router="topk_softmax", router_bias=True,
                           expert_bias=True, swiglu_limit=float(config.swiglu_limit),
                           swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)))

    @staticmethod
    def checkpoint_name(key: str) -> str | None:
        return key.replace(".mlp.router.", ".mlp.gate.")

    def load_special_weight(self, name, key, read):
        if name.endswith("_scales"):
            return {}  # read with its blocks
        if name.endswith("_blocks"):
            scales_key = key.removesuffix("_blocks") + "_scales"
            scales = read(scales_key)
            if scales is None:
                raise ValueError(f"mxfp4 weight {key!r} has no {scales_key!r} in the checkpoint")
            moe_name = name.removesuffix("_blocks")
            dtype = self.model.embed_tokens.weight.dtype
            weight = mxfp4.dequantize(read(key), scales, dtype, key)  # [E, out, in]: our orientation
            return self._load_experts(moe_name, weight, out_in=True)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj", "_proj_bias")):
            return self._load_experts(name, read(key), out_in=False)
        return super().load_special_weight(name, key, read)

    def _load_experts(self, name: str, tensor: torch.Tensor, out_in: bool) -> dict:
        """gpt-oss's stacked tensors: [E, in, out] (float) or [E, out, in] (MXFP4), gate/up interleaved."""
        module, projection = name.rsplit(".", 1)
        bias = projection.endswith("_bias")
        if not bias and not out_in:
            tensor = tensor.transpose(1, 2)
        if projection.startswith("gate_up"):  # rows 2j are gate, 2j + 1 up: gate rows first, then up rows
            tensor = torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
        return self.load_stacked(module, projection.removesuffix("_bias"), bias, tensor.contiguous())

    def use_triton_kernels(self) -> None:
        """gpt-oss's fp32-weight norms stay in torch; the rotary and expert kernels apply."""
        for rotary in self.model.rotaries:
            rotary.fused = True
        for moe in self.experts_modules().values():
            moe.fused = True
