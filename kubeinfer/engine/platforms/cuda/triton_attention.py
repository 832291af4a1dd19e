"""Triton kernels for attention over the paged KV cache, and the attention backend that uses them.

Two kernels cover a step:
  * `write_kv_cache`: scatters the step's new K/V rows into their cache slots (slot_mapping);
    a negative slot is padding and writes nothing (padded CUDA-graph batches need that).
  * `paged_attention`: one flash-attention kernel for decodes, prefills and chunked prefills. Each
    program takes one sequence, one KV head and a tile of that sequence's queries; its queries are the
    last `q_len` positions of the `context_len` tokens in the cache (causal with an offset), so a
    decode is simply q_len == 1 and a chunked prefill reads its cached prefix like any other key.
    Keys are gathered token by token through the block table, so any power-of-two block size works
    and the KV tile size is free of it. GQA: all query heads of a KV head are packed into the rows of
    one tile, so each K/V tile is read once per group, not once per query head. Decodes and prefills
    are two launches of the same kernel with different query tiles (1 query per tile for decodes).

Maths is fp32 (online softmax in exp2). bf16/fp16 inputs feed the tensor cores directly on a GPU; in
Triton's CPU interpreter (TRITON_INTERPRET=1) bf16 arithmetic is wrong, so there, and for fp32 models,
every load is widened to fp32 first and dots run at full ("ieee") precision.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...triton_utils import MIN_DOT, must_upcast, unit_last_stride
from ...model_executor.layers.attention import AttentionBackend

NO_WINDOW = 1 << 30  # a sliding window wider than any context: full attention without a branch


@triton.jit
def _fp8_bits(x, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """float32 x within the 8-bit type's range to its bits, rounded to nearest even as torch's cast rounds, by
    integer ops and one float add: exact on every GPU and in the interpreter. Triton's own downcast goes
    through float16 truncated (`cvt.rz.f16.f32`) on sm_80 and, in Triton 3.6, on sm_89: rounded twice, 0.4% of
    float32 inputs one step off (16-bit inputs are exact in float16); the interpreter misrounds carries."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    DROP: tl.constexpr = 23 - MANTISSA  # float32's mantissa bits that go
    normal = (magnitude + ((BIAS - 127) << 23) + ((1 << (DROP - 1)) - 1) + ((magnitude >> DROP) & 1)) >> DROP
    # below the smallest normal (2^(1 - BIAS)): added to 2^(24 - BIAS - MANTISSA), whose float32 step is the
    # subnormal step, the sum's low bits are the subnormal, rounded to nearest even by the float add itself
    MAGIC: tl.constexpr = (151 - BIAS - MANTISSA) << 23
    magic = tl.full(x.shape, MAGIC, tl.int32).to(tl.float32, bitcast=True)
    subnormal = (magnitude.to(tl.float32, bitcast=True) + magic).to(tl.int32, bitcast=True) - MAGIC
    fp8 = tl.where(magnitude < ((128 - BIAS) << 23), subnormal, normal)
    return (fp8 | ((bits >> 24) & 128)).to(tl.uint8)


@triton.jit
def _bf16_bits(x):
    """float32 x to bfloat16 bits, rounded to nearest even as torch's cast rounds (--kv-cache-dtype bfloat16 under
    a float32 or float16 model), by integer ops: the interpreter's own cast truncates. A NaN stays a NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, (bits >> 16) | 0x40, rounded).to(tl.uint16)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
                     DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8_MAX: tl.constexpr = 0.0,
                     TO_BF16: tl.constexpr = False):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if FP8_MAX > 0:  # an 8-bit cache saturates, as vLLM's (a bare cast overflows e5m2 to inf), and rounds to
        # nearest even, as torch's cast does: e4m3 (largest 448) 3 mantissa bits, bias 7; e5m2 2 and 15
        k, v = tl.clamp(k.to(tl.float32), -FP8_MAX, FP8_MAX), tl.clamp(v.to(tl.float32), -FP8_MAX, FP8_MAX)
        if FP8_MAX == 448.0:
            k, v = _fp8_bits(k, 3, 7), _fp8_bits(v, 3, 7)
        else:
            k, v = _fp8_bits(k, 2, 15), _fp8_bits(v, 2, 15)
        k = k.to(k_cache_ptr.dtype.element_ty, bitcast=True)
        v = v.to(v_cache_ptr.dtype.element_ty, bitcast=True)
    if TO_BF16:  # a bf16 cache under a wider model: rounded as torch's cast
        k = _bf16_bits(k.to(tl.float32)).to(k_cache_ptr.dtype.element_ty, bitcast=True)
        v = _bf16_bits(v.to(tl.float32)).to(v_cache_ptr.dtype.element_ty, bitcast=True)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] (any row strides); caches: [num_blocks, block_size, Hkv, D]; slot_mapping: [T]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = unit_last_stride(k), unit_last_stride(v)
    _check_caches(k_cache, v_cache)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        FP8_MAX=float(torch.finfo(k_cache.dtype).max) if k_cache.element_size() == 1 else 0.0,
        TO_BF16=k_cache.dtype == torch.bfloat16 and k.dtype != torch.bfloat16)


@triton.jit
def _paged_attention_kernel(
        q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr,
        seq_offset, scale_log2, window, softcap, sinks_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    # A tile's BLOCK_M rows are BLOCK_Q queries x GROUP_PAD heads (the padding heads are masked off).
    seq = seq_offset + tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = context_len - q_len + q_idx  # the query's position in its sequence
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # The keys this tile can see: up to its last query, and no further back than the window allows.
    first_pos = context_len - q_len + q_tile * BLOCK_Q
    hi = tl.minimum(first_pos + BLOCK_Q, context_len)
    lo = tl.maximum(first_pos - window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (keys % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache widens to the queries' type; a no-op otherwise
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        if SOFTCAP:  # scale_log2 is the plain scale here: cap softcap * tanh(s / softcap), then to log2 units
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0)) * 1.4426950408889634
        visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None]) & (keys[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet stays at zero
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    if SINKS:  # the head's sink logit joins the denominator (in log2 units), attending to nothing
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_final = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_final)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_final)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, context_lens: torch.Tensor, *, first_seq: int, num_seqs: int,
                    max_query_len: int, scale: float, sliding_window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    block_m: int | None = None,
                    block_n: int = 64) -> torch.Tensor:
    """Attention of sequences first_seq .. first_seq + num_seqs - 1 of a flat batch.

    q: [T, H, D]; caches: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks];
    query_start_loc: [B + 1] and context_lens: [B] (tokens in the cache, this step's included) on q's device.
    Writes the rows of those sequences into `out` ([T, H, D], allocated when None) and returns it.
    `block_m` rows per program (queries x heads of a group; default 64, or 16 when every sequence has
    one query) and `block_n` keys per inner step; both powers of two >= 16. `softcap`: scores become
    softcap * tanh(scores / softcap) before the softmax (Gemma 2). `sinks` [H]: a logit per head in the
    softmax's denominator (gpt-oss).
    """
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    _check_caches(k_cache, v_cache)
    q = unit_last_stride(q)
    out = torch.empty_like(q) if out is None else out
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be a {tuple(q.shape)} tensor with a contiguous last dimension")
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if block_m is None:
        block_m = MIN_DOT if max_query_len == 1 else 64
    block_m = max(block_m, group_pad, MIN_DOT)
    block_q = block_m // group_pad
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        q, out, k_cache, v_cache, block_tables, query_start_loc, context_lens,
        # log2(e): softmax in exp2 (applied after the cap when there is one)
        first_seq, scale if softcap else scale * 1.4426950408889634, sliding_window or NO_WINDOW, float(softcap or 0.0),
        sinks if sinks is not None else q,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=max(block_n, MIN_DOT),
        HEAD_DIM=head_dim, DIM_PAD=max(triton.next_power_of_2(head_dim), MIN_DOT), BLOCK_SIZE=k_cache.shape[1],
        UPCAST=must_upcast(q), SOFTCAP=bool(softcap), SINKS=sinks is not None)
    return out


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    # The kernels address both caches with k_cache's strides.
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] tensors "
                         "of one layout with a contiguous last dimension")


class TritonAttentionBackend(AttentionBackend):
    """The paged-attention backend for GPUs: one KV-write launch and at most two attention launches
    (decodes, then prefills) per layer. It reads only device tensors and host integers from the
    metadata, so decode steps can be captured in CUDA graphs."""
    name = "triton"
    supports_cuda_graphs = True

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, softcap=None, sinks=None):
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        nd, num_seqs = meta.num_decodes, meta.num_seqs
        if meta.query_start_tensor is None:
            raise ValueError("the triton backend needs AttentionMetadata.query_start_tensor")
        args = (q, k_cache, v_cache, meta.block_tables, meta.query_start_tensor, meta.context_lens_tensor)
        common = dict(scale=scale, sliding_window=meta.sliding_window, softcap=softcap, sinks=sinks, out=out)
        if nd:
            paged_attention(*args, first_seq=0, num_seqs=nd, max_query_len=1, **common)
        if num_seqs > nd:
            paged_attention(*args, first_seq=nd, num_seqs=num_seqs - nd, max_query_len=meta.max_prefill_len, **common)
        return out
