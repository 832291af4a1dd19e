"""The torch attention backend (the CPU path) against per-sequence SDPA in float64, in fp32 and bf16.

bf16 decodes on the CPU take their own route (two batched matmuls per KV-head group, softmax in fp32)
because torch's masked SDPA is slow in half precision there; this checks that route too, with the
batch of test_triton_kernels: decodes of ragged lengths, a fresh prompt, chunks after a cached prefix,
GQA groups of 1 to 4, head_dim 24, block sizes 1 to 16 and a sliding window.
"""
from __future__ import annotations

import pytest
import torch

from test_triton_kernels import (NUM_DECODES, SEQUENCES, SHAPES, make_batch, new_token_slots, reference_attention,
                                 tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_torch_backend_matches_sdpa(shape, dtype):
    from kubeinfer.engine.model_executor.layers.attention import AttentionMetadata
    from kubeinfer.engine.model_executor.layers.attention_selector import get_attention_backend

    b = make_batch(shape, dtype, "cpu", seed=3)
    heads, kv_heads, head_dim, block_size, window = shape
    slots = new_token_slots(b["tables"], block_size)
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build(slots, b["starts"], [ctx for ctx, _ in SEQUENCES], b["tables"], NUM_DECODES,
                                   window, torch.device("cpu"))
    out = get_attention_backend("torch").forward(b["q"], k, v, b["k_cache"], b["v_cache"], meta, head_dim ** -0.5)
    assert out.dtype == dtype
    want = reference_attention(b["q"], b["k_cache"], b["v_cache"], b["tables"], b["starts"], window, head_dim ** -0.5)
    torch.testing.assert_close(out.double(), want, **tolerance(dtype))
