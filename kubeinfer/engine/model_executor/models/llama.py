"""Decoder-only transformer for the Llama family and its close relatives.

Llama, Mistral, Qwen2 and Qwen3 differ only in small switches, read from the config:
biases on q/k/v (Qwen2, or `attention_bias`), per-head RMSNorm on q and k before RoPE (Qwen3),
sliding-window attention (Mistral), an explicit head_dim, tied embeddings. Tokens of all sequences
in a step run flattened ([T, hidden]); only attention needs to know where sequences begin and end.
q/k/v and gate/up projections are fused into one matmul each at load time.

The other families (gemma.py, phi3.py, olmo2.py, granite.py) build on these classes through their hooks:
the attention's norm, scale, score cap and window; the decoder layer class; the embedding and logits steps.

A decode step's path calls submodules through `.forward`: no hooks are set on the engine's modules, and
nn.Module.__call__ costs ~0.5 us a call, ~110 calls a step at batch 1 on the CPU (where a whole step is ~5 ms).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ...platforms import decoder_fast_path, fused_silu_mul
from ...config import ModelSpec, Part
from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.layernorm import RMSNorm
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from ..layers.rotary_embedding import RotaryEmbedding
from ..layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

if TYPE_CHECKING:
    from ...lora.layers import LoRAContext

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, rotary: RotaryEmbedding, layer_idx: int, *,
                 qk_norm: bool | None = None, norm: type[nn.Module] = RMSNorm, scale: float | None = None,
                 softcap: float | None = None) -> None:
        """qk_norm: per-head norms on q and k before RoPE (default: the spec's, Qwen3), of class `norm`;
        scale: of the scores (default head_dim ** -0.5); softcap: scores capped by tanh (Gemma 2)."""
        super().__init__()
        qk_norm = spec.qk_norm if qk_norm is None else qk_norm
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Tensor parallelism: the spec is this rank's (its heads); q/k/v split by head, o_proj by input.
        self.qkv_proj = ColumnParallelLinear(spec.hidden_size, spec.qkv_parts(), bias=spec.qkv_bias)
        heads = Part(spec.total_heads * self.head_dim, spec.tp_rank * self.q_size, self.q_size)
        self.o_proj = RowParallelLinear(heads, spec.hidden_size, spec.o_bias, spec.tp_size)
        self.q_norm = norm(self.head_dim, spec.rms_norm_eps) if qk_norm else None
        self.k_norm = norm(self.head_dim, spec.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        self.window = spec.layer_windows[layer_idx]  # the step's metadata has the model's; this layer's may differ
        self.softcap = softcap

    def forward(self, x, positions, kv_cache, meta: AttentionMetadata, lora: LoRAContext | None = None):
        qkv = _project(self.qkv_proj, x, lora, self.layer_idx, "qkv_proj")
        if self.q_norm is None and not self.rotary.fused:
            return self._attend(*self._rotate_side_by_side(qkv, positions), kv_cache, meta, lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self._attend(q, k, v, kv_cache, meta, lora)

    def _rotate_side_by_side(self, qkv: torch.Tensor, positions: torch.Tensor):
        """q, k, v from the fused projection, q and k rotated in one pass: they lie side by side in each row
        (one rotation over H + Hkv heads costs what one over H did; a step's small ops are its overhead)."""
        heads = self.num_heads + self.num_kv_heads
        rows = qkv.reshape(-1, heads + self.num_kv_heads, self.head_dim)  # [T, H + 2 Hkv, D]: a view
        # views by split_with_sizes: ~1 us each, where Tensor.split adds ~1.5 us of Python (every layer, every step)
        qk, v = rows.split_with_sizes([heads, self.num_kv_heads], 1)
        qk = self.rotary.rotate_scratch(positions, qk)  # qkv is this step's scratch: rotated in place on the CPU
        q, k = qk.split_with_sizes([self.num_heads, self.num_kv_heads], 1)
        return q, k, v

    def _attend(self, q, k, v, kv_cache, meta: AttentionMetadata, lora: LoRAContext | None) -> torch.Tensor:
        if self.window != meta.sliding_window:
            meta = meta.for_window(self.window)
        if self.softcap:
            out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.softcap)
        else:
            out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        out = out.reshape(-1, self.q_size)
        return _project(self.o_proj, out, lora, self.layer_idx, "o_proj")


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate_size = spec.intermediate_size
        parts = spec.gate_up_parts()  # this rank's columns of gate and of up; down_proj takes them as input
        self.gate_up_proj = ColumnParallelLinear(spec.hidden_size, parts, bias=spec.mlp_bias)
        self.down_proj = RowParallelLinear(parts[0], spec.hidden_size, spec.mlp_bias, spec.tp_size)
        self.activation = ACTIVATIONS[spec.hidden_act]

    def forward(self, x, lora: LoRAContext | None = None):
        gate_up = _project(self.gate_up_proj, x, lora, self.layer_idx, "gate_up_proj")
        if self.activation is F.silu and gate_up.is_cpu:  # one native pass (float32)
            h = fused_silu_mul(gate_up, self.intermediate_size)
            if h is not None:
                return _project(self.down_proj, h, lora, self.layer_idx, "down_proj")
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return _project(self.down_proj, self.activation(gate) * up, lora, self.layer_idx, "down_proj")


def _project(linear: nn.Linear, x: torch.Tensor, lora: LoRAContext | None, layer: int, module: str) -> torch.Tensor:
    """The base projection, plus each token's own adapter delta when the step has adapters. A row-parallel
    projection's delta joins its partial sum before the ranks' shares are added (A is split like its input)."""
    if lora is None:
        return linear.forward(x)
    if isinstance(linear, RowParallelLinear) and linear.tp_size > 1:
        return linear.reduce(lora.apply(linear.partial(x), x, layer, module))
    return lora.apply(linear(x), x, layer, module)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, rotary: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, backend, rotary, layer_idx)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, layer_idx)

    def forward(self, x, residual, positions, kv_cache, meta, lora: LoRAContext | None = None):
        """x: the previous layer's output (the embeddings at the first layer); residual: the running sum
        of the outputs before it (None at the first layer). Returns this layer's (output, residual); the
        residual adds are done inside the norms, where a fused kernel does them for free."""
        if residual is None:
            h, residual = self.input_layernorm.forward(x), x
        else:
            h, residual = self.input_layernorm.forward(x, residual)
        h = self.self_attn.forward(h, positions, kv_cache, meta, lora)
        h, residual = self.post_attention_layernorm.forward(h, residual)
        return self.mlp.forward(h, lora), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, rotaries: list[RotaryEmbedding],
                 layer_class: type[nn.Module], norm: type[nn.Module]) -> None:
        """rotaries: each layer's (Gemma 3's local and global layers have their own)."""
        super().__init__()
        self.spec = spec
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, spec.tp_rank, spec.tp_size)
        self.layers = nn.ModuleList(layer_class(spec, backend, rotaries[i], i) for i in range(spec.num_layers))
        self.norm = norm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = rotaries[0]
        self.rotaries = list(dict.fromkeys(rotaries))  # each once: their step tables are reset per step


class CausalLM(nn.Module):
    """Llama, Mistral, Qwen2, Qwen3; the base class of the other families."""
    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[nn.Module] = RMSNorm
    checkpoint_fused = False  # the checkpoint holds q/k/v and gate/up apart; we fuse them at load time
    native_decode_types = (DecoderLayer, Attention, MLP)  # what platforms/cpu/native_decode.py may run in one call

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec, backend, self.make_rotaries(spec, max_positions), self.layer_class,
                                  self.norm_class)
        self.lm_head = ParallelLMHead(spec.hidden_size, spec.vocab_size, spec.tp_rank, spec.tp_size)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, logits_indices: torch.Tensor, lora: LoRAContext | None = None) -> torch.Tensor:
        """Runs the step's flat tokens; returns logits [len(logits_indices), vocab] for the rows
        that sample (the last computed token of each sequence that completes its prompt or decodes).
        `lora` routes each token to its adapter's delta; None runs the base model alone."""
        for rotary in self.model.rotaries:
            rotary.begin_step()
        x, residual = self.embed(input_ids), None
        native = decoder_fast_path(self, x, positions, kv_caches, meta, lora)
        if native is not None:  # a CPU decode step: runs of whole layers in one C call each (platforms/cpu)
            x, residual = native
        else:
            for layer, kv_cache in zip(self.model.layers, kv_caches):
                x, residual = layer.forward(x, residual, positions, kv_cache, meta, lora)
        if logits_indices.shape[0] != x.shape[0]:  # as many rows as tokens: every row samples (increasing, distinct)
            x, residual = x[logits_indices], residual[logits_indices]
        x, _ = self.model.norm(x, residual)
        return self.logits(x)

    @staticmethod
    def make_rotaries(spec: ModelSpec, max_positions: int) -> list[RotaryEmbedding]:
        """Each layer's rotary embedding: one shared by all here."""
        return [RotaryEmbedding(spec.head_dim, max_positions, spec.rope_theta, spec.rope_scaling)] * spec.num_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    @staticmethod
    def checkpoint_name(key: str) -> str | None:
        """The parameter a checkpoint tensor loads into (before q/k/v and gate/up are fused); None: skip it."""
        return key

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x).float()

    def use_triton_kernels(self) -> None:
        """Fused Triton RMSNorm (with its residual add) and rotary embedding, for the GPU path. Qwen3's
        per-head q/k norms stay in torch: they run on strided [T, heads, head_dim] views."""
        for layer in self.model.layers:
            layer.input_layernorm.fused = layer.post_attention_layernorm.fused = True
        self.model.norm.fused = True
        self.model.rotary.fused = True
