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


def _consecutive(batch: dict, block_size: int) -> dict:
    """The same batch with each sequence's blocks renumbered to consecutive ids (the cache permuted to match)."""
    tables = batch["tables"]
    order = []  # old block id of each new id, sequence by sequence
    for i, (ctx, _) in enumerate(SEQUENCES):
        order += tables[i, :-(-ctx // block_size)].tolist()
    num_blocks = batch["k_cache"].shape[0]
    order += [b for b in range(num_blocks) if b not in order]
    new_id = {old: new for new, old in enumerate(order)}
    renumbered = tables.clone().apply_(lambda b: new_id[b])
    return dict(batch, tables=renumbered, k_cache=batch["k_cache"][order], v_cache=batch["v_cache"][order])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_consecutive_blocks_are_sliced_and_attend_the_same(shape, dtype, monkeypatch):
    """With the host block tables at hand, a sequence whose blocks are consecutive ids reads its context as a
    slice of the cache: prompts and chunks always, a decode when it is the step's only sequence. Gathering
    is refused here for those, so a slice that read the wrong rows could not hide behind a gather."""
    from kubeinfer.engine.model_executor.layers import attention
    from kubeinfer.engine.model_executor.layers.attention import AttentionMetadata
    from kubeinfer.engine.model_executor.layers.attention_selector import get_attention_backend

    heads, kv_heads, head_dim, block_size, window = shape
    b = _consecutive(make_batch(shape, dtype, "cpu", seed=3), block_size)
    slots = new_token_slots(b["tables"], block_size)
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(dtype)
    gathered = attention.gather_context
    monkeypatch.setattr(attention, "gather_context", lambda cache, tables, length: (
        gathered(cache, tables, length) if tables.shape[0] > 1 else pytest.fail("gathered a consecutive context")))
    backend, lists = get_attention_backend("torch"), b["tables"].tolist()
    meta = AttentionMetadata.build(slots, b["starts"], [ctx for ctx, _ in SEQUENCES], b["tables"], NUM_DECODES,
                                   window, torch.device("cpu"), block_table_lists=lists)
    out = backend.forward(b["q"], k, v, b["k_cache"], b["v_cache"], meta, head_dim ** -0.5)
    want = reference_attention(b["q"], b["k_cache"], b["v_cache"], b["tables"], b["starts"], window, head_dim ** -0.5)
    torch.testing.assert_close(out.double(), want, **tolerance(dtype))
    for i in range(NUM_DECODES):  # each decode alone in its step
        ctx, _ = SEQUENCES[i]
        start = b["starts"][i]
        alone = AttentionMetadata.build(slots[start:start + 1], [0, 1], [ctx], b["tables"][i:i + 1], 1, window,
                                        torch.device("cpu"), block_table_lists=lists[i:i + 1])
        out = backend.forward(b["q"][start:start + 1], k[start:start + 1], v[start:start + 1], b["k_cache"],
                              b["v_cache"], alone, head_dim ** -0.5)
        torch.testing.assert_close(out.double(), want[start:start + 1], **tolerance(dtype))
