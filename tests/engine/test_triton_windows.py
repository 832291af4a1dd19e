"""The Triton paged-attention kernel with Gemma's switches against torch, under the interpreter on a CPU
(fp32 maths) or compiled on a GPU: a sliding window per call (local and global layers of one step), tanh
score capping (Gemma 2); then the engine on the triton backend against transformers for Gemma 2 and 3."""
from __future__ import annotations

import pytest
import torch
from test_triton_kernels import DEVICES

# (context length, new tokens) per sequence: decodes first, then prefills and chunks longer than the window.
SEQUENCES = [(9, 1), (30, 1), (3, 1), (21, 21), (40, 13), (17, 5)]
NUM_DECODES = 3


def reference(q, k_cache, v_cache, tables, starts, window, scale, softcap):
    """Each sequence alone, in float64: scores * scale, capped, masked (causal, window), softmax."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    for i, (ctx, new) in enumerate(SEQUENCES):
        keys = k_cache[tables[i]].flatten(0, 1)[:ctx].transpose(0, 1).cpu().double().repeat_interleave(group, 0)
        values = v_cache[tables[i]].flatten(0, 1)[:ctx].transpose(0, 1).cpu().double().repeat_interleave(group, 0)
        query = q[starts[i]:starts[i + 1]].transpose(0, 1).cpu().double()  # [H, new, D]
        scores = query @ keys.transpose(1, 2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos, k_pos = torch.arange(ctx - new, ctx)[:, None], torch.arange(ctx)[None, :]
        visible = k_pos <= q_pos
        if window:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[starts[i]:starts[i + 1]] = (torch.softmax(scores, -1) @ values).transpose(0, 1)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window, softcap", [(6, None), (6, 2.0), (None, 2.0), (1, None)],
                         ids=["window", "window-softcap", "softcap", "window-1"])
def test_paged_attention_window_and_softcap_match_torch(window, softcap, device):
    from kubeinfer.engine.platforms.cuda.triton_attention import paged_attention

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 4
    tables = torch.randperm(64, generator=gen)[:6 * 10].view(6, 10)
    k_cache = torch.randn(64, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(64, block_size, kv_heads, head_dim, generator=gen)
    starts = [0]
    for _, new in SEQUENCES:
        starts.append(starts[-1] + new)
    q = torch.randn(starts[-1], heads, head_dim, generator=gen)
    scale = 0.5  # large scores, so the cap bites
    args = (q.to(device), k_cache.to(device), v_cache.to(device), tables.to(device),
            torch.tensor(starts, dtype=torch.int32, device=device),
            torch.tensor([ctx for ctx, _ in SEQUENCES], device=device))
    common = dict(scale=scale, sliding_window=window, softcap=softcap, block_m=16, block_n=16)
    out = paged_attention(*args, first_seq=0, num_seqs=NUM_DECODES, max_query_len=1, **common)
    paged_attention(*args, first_seq=NUM_DECODES, num_seqs=len(SEQUENCES) - NUM_DECODES,
                    max_query_len=max(new for _, new in SEQUENCES), out=out, **common)
    want = reference(q, k_cache, v_cache, tables, starts, window, scale, softcap)
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=1e-5)
    # The switch matters here: without it the answer is another one.
    other = reference(q, k_cache, v_cache, tables, starts, None if window else 6, scale, None if softcap else 2.0)
    assert not torch.allclose(other, want, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["gemma2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_engine_on_triton_matches_transformers(family, device, tmp_path):
    """Local and global layers in one step, scores capped (Gemma 2), chunks and preemption, on the kernels."""
    from test_model_families import MAX_TOKENS, PROMPTS, VARIANTS, hf_references, run

    from kubeinfer.engine import LLM
    from kubeinfer.dev.testing.random_model import build_random_model

    path = build_random_model(tmp_path / family, family, tokenizer=False, seed=7, **VARIANTS[family])
    llm = LLM(str(path), device=device, dtype="float32", attention_backend="triton", block_size=4,
              num_kv_blocks=14, max_num_batched_tokens=16)
    assert llm.engine.runner.backend.name == "triton"
    assert run(llm, PROMPTS, MAX_TOKENS) == hf_references(path)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("device", DEVICES)
def test_decode_graphs_with_local_and_global_layers(device, tmp_path):
    """Decode graphs replay Gemma 2's local and global layers (each with its window and block pool) and
    capped scores."""
    from test_cuda_graphs import _capture
    from test_model_families import MAX_TOKENS, PROMPTS, VARIANTS, hf_references, run

    from kubeinfer.engine import LLM
    from kubeinfer.dev.testing.random_model import build_random_model

    path = build_random_model(tmp_path / "gemma2", "gemma2", tokenizer=False, seed=8, **VARIANTS["gemma2"])
    llm = LLM(str(path), device=device, dtype="float32", attention_backend="triton", block_size=4, max_num_seqs=8,
              enforce_eager=True, num_kv_blocks=64)  # a fixed cache, not 90% of the GPU: GPU tests share one
    assert llm.engine.runner.window_pool  # the local layers' blocks in their own pool, with their own tables
    graphs = _capture(llm, device)
    assert run(llm, PROMPTS, MAX_TOKENS) == hf_references(path)
    assert graphs.num_replays > 0
