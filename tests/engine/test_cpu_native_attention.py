"""The native CPU decode attention (platforms/cpu/native/attention.c through platforms/cpu/cpu_attention.py).

Against a plain softmax(q.k * scale).v in float64 written here (each sequence's context picked position by position
through its block table): batch 1 and ragged batches, block tables out of order, MHA and GQA, head_dim 64 and 128,
a sliding window, float32 and bf16 queries and caches, fp8 caches. Tolerances: float32 1e-5 (absolute and
relative; measured ~1e-6); bf16 the output's own rounding (2**-8 relative) plus the inputs' (2e-2); fp8 caches
as float32 (the cache values widen exactly). Then: a sequence's bits do not depend on its batch nor the thread
count; a decode step's K/V write leaves the cache's bytes equal to index_copy_'s (fp8 saturation included);
the engine's greedy tokens equal transformers' and the torch path's, and KUBEINFER_CPU_NATIVE_LAYERS=0 takes
the torch path."""
from __future__ import annotations

import pytest
import torch
from native_builds import outputs_by_level, outputs_of_both_builds

from kubeinfer.engine.platforms.cpu import cpu_attention
from kubeinfer.engine.model_executor.layers.attention import AttentionMetadata, TorchAttentionBackend
from kubeinfer.engine.platforms.cpu.native import ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler: the native kernels do not build here")
BLOCK = 16
LENGTHS = [23, 1, 40, 16, 33, 17]  # ragged; 16 and 17 around a block's end
HEADS = {"mha-d64": (8, 8, 64), "gqa2-d64": (16, 8, 64), "gqa4-d128": (8, 2, 128)}  # (H, Hkv, D)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_step(lengths, heads, kv_heads, head_dim, dtype, cache_dtype=None, window=None, seed=0):
    """Caches with each sequence's blocks scattered (a random permutation), queries, and the step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(blocks) + 2
    physical = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.long)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = physical[used:used + n]
        used += n
    shape = (num_blocks, BLOCK, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(cache_dtype or dtype) for _ in range(2))
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype)
    slots = [int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for i, n in enumerate(lengths)]
    meta = AttentionMetadata.build(slots, list(range(len(lengths) + 1)), lengths, tables, len(lengths), window,
                                   torch.device("cpu"))
    return q, k_cache, v_cache, meta


def reference(q, k_cache, v_cache, meta, scale):
    """[B, H, D] float64: each (sequence, head) alone over the positions it attends, read through its table."""
    batch, heads, _ = q.shape
    group = heads // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(batch):
        n = meta.context_lens[b]
        pos = torch.arange(max(0, n - meta.sliding_window) if meta.sliding_window else 0, n)
        where = meta.block_tables[b, pos // BLOCK], pos % BLOCK
        keys = k_cache[where].double().repeat_interleave(group, dim=1)  # [n, H, D]
        values = v_cache[where].double().repeat_interleave(group, dim=1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), keys) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, values)
    return out


@pytest.mark.parametrize("window", [None, 5, 20], ids=["full", "window5", "window20"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("lengths", [[23], LENGTHS], ids=["batch1", "ragged"])
def test_matches_softmax_attention(lengths, heads, dtype, window):
    q, k_cache, v_cache, meta = make_step(lengths, *heads, dtype, window=window)
    scale = heads[2] ** -0.5
    out = cpu_attention.decode(q, k_cache, v_cache, meta, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, meta, scale), **TOL[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fp8_cache_widens_each_byte_exactly(dtype, cache_dtype):
    q, k_cache, v_cache, meta = make_step(LENGTHS, 16, 8, 64, dtype, cache_dtype, window=20, seed=2)
    out = cpu_attention.decode(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, meta, 0.125), **TOL[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_bytes_widen_to_torchs_bits(cache_dtype, monkeypatch):
    """Every byte value (NaNs, infinities, subnormals, signed zeros): a one-position context returns its V row
    (softmax of one score is 1), so the output is the byte widened, bit for bit as torch's cast; both builds."""
    from native_builds import outputs_by_level, outputs_of_both_builds

    q, k_cache, v_cache, meta = make_step([1] * 4, 4, 4, 64, torch.float32, cache_dtype, seed=4)
    rows = [int(meta.slot_mapping[i]) for i in range(4)]
    v_cache.view(-1, 4, 64)[rows] = torch.arange(256, dtype=torch.uint8).repeat(4).view(4, 4, 64).view(cache_dtype)
    k_cache.view(-1, 4, 64)[rows] = torch.zeros(4, 4, 64).to(cache_dtype)
    want = v_cache.view(-1, 4, 64)[rows].to(torch.float32) + 0.0  # (-0.0: the weighted sum's 0.0 + 1 * -0.0)
    for out in outputs_of_both_builds(monkeypatch, lambda: cpu_attention.decode(q, k_cache, v_cache, meta, 0.125)):
        assert torch.equal(out.view(torch.int32), want.view(torch.int32))


def test_strided_queries_are_read_in_place():
    """q arrives as a view of the fused qkv rows (its rows further apart than H * D)."""
    q, k_cache, v_cache, meta = make_step(LENGTHS, 16, 8, 64, torch.float32, seed=3)
    wide = torch.cat([q, torch.randn(q.shape[0], 8, 64)], dim=1)[:, :16]
    assert not wide.is_contiguous()
    assert torch.equal(cpu_attention.decode(wide, k_cache, v_cache, meta, 0.125),
                       cpu_attention.decode(q, k_cache, v_cache, meta, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_sequence_has_the_same_bits_alone_and_in_a_batch(dtype):
    q, k_cache, v_cache, meta = make_step(LENGTHS, 16, 8, 64, dtype, window=20, seed=4)
    batched = cpu_attention.decode(q, k_cache, v_cache, meta, 0.125)
    for b, n in enumerate(LENGTHS):
        alone = AttentionMetadata.build([0], [0, 1], [n], meta.block_tables[b:b + 1], 1, 20, torch.device("cpu"))
        assert torch.equal(cpu_attention.decode(q[b:b + 1], k_cache, v_cache, alone, 0.125), batched[b:b + 1]), b
    threads = ops.set_threads(1)
    try:
        assert torch.equal(cpu_attention.decode(q, k_cache, v_cache, meta, 0.125), batched)
    finally:
        ops.set_threads(ops.default_threads())
    assert threads >= 1


def _backend_step(monkeypatch, native: bool, q, k, v, k_cache, v_cache, meta):
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", "1" if native else "0")
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    return out, k_cache, v_cache


CASES = {"f32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
         "f32-bf16": (torch.float32, torch.bfloat16),  # --kv-cache-dtype bfloat16 under the CPU's float32 models
         "f32-e5m2": (torch.float32, torch.float8_e5m2), "bf16-e4m3": (torch.bfloat16, torch.float8_e4m3fn)}


@pytest.mark.parametrize("dtype,cache_dtype", CASES.values(), ids=CASES.keys())
def test_decode_step_writes_the_cache_as_index_copy_and_attends_as_torch(monkeypatch, dtype, cache_dtype):
    """The backend's decode step, native against torch: the same cache bytes after the write (K/V as strided
    views of a qkv row, values beyond e5m2's range to saturate), outputs within the tolerance."""
    q, k_cache, v_cache, meta = make_step(LENGTHS, 16, 8, 64, dtype, cache_dtype, window=20, seed=5)
    qkv = torch.randn(len(LENGTHS), 32, 64).to(dtype) * 4
    qkv[0, 16, :4] = 1e6  # beyond e5m2's 57344: saturates, not inf
    k, v = qkv[:, 16:24], qkv[:, 24:]
    calls = []
    real = cpu_attention.decode
    monkeypatch.setattr(cpu_attention, "decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    want, want_k, want_v = _backend_step(monkeypatch, False, q, k, v, k_cache, v_cache, meta)
    assert not calls  # KUBEINFER_CPU_NATIVE_LAYERS=0: the torch path
    got, got_k, got_v = _backend_step(monkeypatch, True, q, k, v, k_cache, v_cache, meta)
    assert calls
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    torch.testing.assert_close(got.double(), want.double(), **TOL[dtype])
    torch.testing.assert_close(got.double(), reference(q, got_k, got_v, meta, 0.125), **TOL[dtype])


def test_mixed_step_takes_native_decodes_and_torch_prefills(monkeypatch):
    """Decodes then a prompt chunk: the decode rows native, the chunk through torch, as the torch path does."""
    lengths, new = [23, 40, 30], [1, 1, 12]
    gen = torch.Generator().manual_seed(6)
    _, k_cache, v_cache, decodes = make_step(lengths, 16, 8, 64, torch.float32, seed=6)
    tables, starts = decodes.block_tables, [0, 1, 2, 14]
    slots = [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK
             for i, n in enumerate(lengths) for p in range(n - new[i], n)]
    meta = AttentionMetadata.build(slots, starts, lengths, tables, 2, None, torch.device("cpu"))
    q = torch.randn(14, 16, 64, generator=gen)
    k, v = torch.randn(14, 8, 64, generator=gen), torch.randn(14, 8, 64, generator=gen)
    want, want_k, _ = _backend_step(monkeypatch, False, q, k, v, k_cache, v_cache, meta)
    got, got_k, _ = _backend_step(monkeypatch, True, q, k, v, k_cache, v_cache, meta)
    assert torch.equal(got_k, want_k)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.fixture(scope="module")
def window_llama(tmp_path_factory):
    """A tiny Llama-shaped Mistral with an 8-token window, shorter than most prompts: the window matters."""
    from kubeinfer.dev.testing.random_model import build_random_model

    return str(build_random_model(tmp_path_factory.mktemp("native_attn"), "mistral", tokenizer=False,
                                  sliding_window=8, seed=13))


@pytest.mark.parametrize("family", ["llama", "window"])
def test_engine_greedy_matches_transformers_and_the_torch_path(family, model_dirs, window_llama, monkeypatch):
    from test_triton_kernels import MAX_TOKENS, PROMPTS, engine_greedy, hf_greedy
    from transformers import AutoModelForCausalLM

    from kubeinfer.engine import LLM

    path = model_dirs["llama"] if family == "llama" else window_llama
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    calls = []
    real = cpu_attention.decode
    monkeypatch.setattr(cpu_attention, "decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    tokens = {}
    for native in ("1", "0"):
        monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", native)
        before = len(calls)
        tokens[native] = engine_greedy(LLM(path, dtype="float32", block_size=4))
        assert (len(calls) > before) == (native == "1")
    assert tokens["1"] == want
    assert tokens["0"] == want


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["f32", "bf16", "e4m3", "e5m2"])
def test_portable_build_equals_the_avx512_build(monkeypatch, cache_dtype):
    """The AVX-512 build scores 16 positions at a time, folding their lane trees together (D a multiple of 16; a
    bf16 or fp8 cache's rows widened into a tile first): the same additions as the portable build's plain C, so
    the same bits; partial tiles, windows, groups of 1-6 query heads, D 64 and 128."""
    steps = [make_step(lengths, h, kv, d, torch.float32, cache_dtype, window=window, seed=d + h)
             for lengths in ([1, 5, 16, 17, 33, 48], [300, 2]) for h, kv, d in ((8, 8, 64), (16, 8, 64), (12, 2, 128))
             for window in (None, 20)]
    native, portable = outputs_of_both_builds(
        monkeypatch, lambda: [cpu_attention.decode(q, k, v, meta, 0.125) for q, k, v, meta in steps])
    assert all(torch.equal(a, b) for a, b in zip(native, portable))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["f32", "bf16", "e4m3", "e5m2"])
def test_every_level_gives_the_portable_bits(monkeypatch, cache_dtype):
    """The v4, v3 (AVX2: fp8 widened 8 bytes at a time, the plain C vectorized for AVX2) and portable builds, each
    forced: the same bits; D 64, 128 and 40 (not a multiple of 16: the plain C on every level)."""
    steps = [make_step(lengths, h, kv, d, torch.float32, cache_dtype, window=window, seed=d + h)
             for lengths in ([1, 5, 17, 33], [300, 2]) for h, kv, d in ((8, 8, 64), (12, 2, 128), (4, 2, 40))
             for window in (None, 20)]
    outs = outputs_by_level(monkeypatch,
                            lambda: [cpu_attention.decode(q, k, v, meta, 0.125) for q, k, v, meta in steps])
    assert "portable" in outs and len(outs) >= 2, f"only {list(outs)} run here"
    for level, got in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(got, outs["portable"])), level


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["f32", "bf16", "e4m3", "e5m2"])
def test_a_query_group_gives_each_query_alones_bits(cache_dtype):
    """A bf16 or fp8 cache's V rows are widened once for the whole group of query heads sharing a KV head: each
    query's output the same bits as with its own copy of the KV head (a group of one, one query at a time)."""
    q, k_cache, v_cache, meta = make_step([1, 17, 40, 300], 12, 3, 64, torch.float32, cache_dtype, seed=9)
    grouped = cpu_attention.decode(q, k_cache, v_cache, meta, 0.125)
    alone = cpu_attention.decode(q, k_cache.repeat_interleave(4, dim=2).contiguous(),
                                 v_cache.repeat_interleave(4, dim=2).contiguous(), meta, 0.125)
    assert torch.equal(grouped, alone)
