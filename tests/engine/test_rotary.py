"""Rotary embeddings of the torch path against transformers' own (LlamaRotaryEmbedding and
apply_rotary_pos_emb), for q and k rotated side by side in one pass as the model does, and the per-step
table lookup that the layers of a step share."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kubeinfer.engine.model_executor.layers.rotary_embedding import RotaryEmbedding

HEAD_DIM, HEADS, KV_HEADS, MAX_POSITIONS = 16, 4, 2, 64
SCALINGS = {
    "default": {},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


def reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, scaling: dict):
    config = LlamaConfig(hidden_size=HEAD_DIM * HEADS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=MAX_POSITIONS, rope_theta=10000.0, rope_scaling=scaling or None)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    # transformers' layout is [batch, heads, tokens, D]; ours [tokens, heads, D]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1)


@pytest.mark.parametrize("scaling", SCALINGS.values(), ids=SCALINGS.keys())
def test_q_and_k_rotated_side_by_side_match_transformers(scaling):
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITIONS, 10000.0, scaling)
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 5, 17, 63])
    qkv = torch.randn(4, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)  # a fused projection's rows
    qk = qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].reshape(4, HEADS + KV_HEADS, HEAD_DIM)  # a strided view
    rotated = rotary.rotate(positions, qk)
    q_ref, k_ref = reference(positions, qk[:, :HEADS], qk[:, HEADS:], scaling)
    torch.testing.assert_close(rotated[:, :HEADS], q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rotated[:, HEADS:], k_ref, atol=1e-6, rtol=1e-6)
    q, k = rotary(positions, qk[:, :HEADS], qk[:, HEADS:])  # the separate path (Qwen3's, after its q/k norms)
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, k_ref, atol=1e-6, rtol=1e-6)


def test_a_new_step_looks_its_positions_up_again():
    """The layers of a step share one lookup of cos/sin; a CUDA graph refills the same positions tensor in
    place between steps, so the tables are looked up again after `begin_step` even for the same tensor."""
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITIONS, 10000.0, {})
    x = torch.randn(2, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([1, 2])
    first = rotary.rotate(positions, x)
    assert torch.equal(rotary.rotate(positions, x), first)  # the same step: the shared lookup
    positions.copy_(torch.tensor([30, 40]))
    rotary.begin_step()
    want, _ = reference(torch.tensor([30, 40]), x, x[:, :KV_HEADS], {})
    torch.testing.assert_close(rotary.rotate(positions, x), want, atol=1e-6, rtol=1e-6)
