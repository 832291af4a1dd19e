"""Triton kernels for RMSNorm (optionally fused with the residual add before it) and rotary embeddings.

  * `rms_norm`: one program per row does the residual add, the fp32 mean of squares, the scaling and the
    weight in one pass over the row; eager torch needs 7-8 kernels for RMSNorm alone (cast, pow, mean,
    add, rsqrt, mul, cast, mul) plus one for the residual add.
  * `apply_rotary`: one program per token rotates every query and key head in place, reading cos/sin once;
    eager torch needs ~20 kernels for q and k (gathers, casts, chunks, four products, sums, cats).

Eager decode at small batch is launch-bound, so kernel count, not bytes moved, is what these save.
Both match the torch references (`RMSNorm` in models/llama.py, `RotaryEmbedding` in rope.py) operation
for operation: loads are widened to fp32, the maths is fp32, and every rounding torch does to the model
dtype is done here at the same point. Triton's CPU interpreter (TRITON_INTERPRET=1) truncates fp32 to
bf16 instead of rounding to nearest even, so there the rounding to bf16 is done by hand (`_round`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...triton_utils import INTERPRETED, unit_last_stride

_SOFT_BF16 = tl.constexpr(INTERPRETED)  # the interpreter's own fp32 -> bf16 cast truncates


@triton.jit
def _round(x, dtype: tl.constexpr):
    # x (fp32) rounded to nearest even in `dtype`, returned as fp32: where torch rounds, we round the same way.
    if _SOFT_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, eps, stride_x, stride_r, stride_o, stride_s,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, dtype)
        tl.store(sum_ptr + row * stride_s + cols, x.to(dtype), mask=mask)
    xn = x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _round(_round(xn, dtype) * w, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`RMSNorm.forward` of x [T, N] (any row stride); the result has torch's promoted dtype of weight and x.

    With `residual` ([T, N], x's dtype) it normalises s = x + residual (rounded to the dtype, as torch
    adds) and returns (rms_norm(s), s), saving the separate add. s goes to a new tensor rather than
    into `residual`, so the inputs are never written and callers need not reason about aliasing.
    """
    num_rows, n = x.shape
    if weight.shape != (n,):
        raise ValueError(f"weight must have shape ({n},) for x of shape {tuple(x.shape)}, got {tuple(weight.shape)}")
    x, weight = unit_last_stride(x), weight.contiguous()
    out = torch.empty((num_rows, n), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must be a {tuple(x.shape)} {x.dtype} tensor like x, got "
                             f"{tuple(residual.shape)} {residual.dtype}")
        residual = unit_last_stride(residual)
        summed = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows:
        block = triton.next_power_of_2(n)
        res, s = (residual, summed) if residual is not None else (x, out)  # unused pointers when no residual
        _rms_norm_kernel[(num_rows,)](
            x, res, weight, out, s, eps, x.stride(0), res.stride(0), out.stride(0), s.stride(0),
            N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=min(max(block // 512, 1), 16))
    return out if residual is None else (out, summed)


@triton.jit
def _rotate_heads(ptr, stride_h, cos, sin, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                  HALF_PAD: tl.constexpr):
    # One token's heads [NUM_HEADS, 2 * HALF] in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HALF)
    first = ptr + heads[:, None] * stride_h + dims[None, :]
    dtype = ptr.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, _round(x1 * cos - x2 * sin, dtype).to(dtype), mask=mask)
    tl.store(first + HALF, _round(x2 * cos + x1 * sin, dtype).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                   KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + pos * stride_c + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_c + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, cos, sin, NUM_HEADS, HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, cos, sin, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`RotaryEmbedding.forward` in place: q [T, H, D], k [T, Hkv, D] (any token/head strides), positions [T],
    cos/sin fp32 [max_positions, D // 2] (RotaryEmbedding's buffers). Returns (q, k), rotated.

    In place because the model's q and k are views of the fused qkv projection output, which nothing reads
    again except through q, k and v; each program reads a token's values before it overwrites them, and
    q and k must not overlap. A q or k whose last dimension is strided is copied first and the copy returned.
    Positions are not range-checked (that would need a device sync): they must be < max_positions.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    if head_dim % 2 or k.shape[2] != head_dim or cos.shape[1] != half or sin.shape != cos.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}: "
                         "need an even head_dim D shared by q and k, and cos/sin of shape [max_positions, D // 2]")
    q, k = unit_last_stride(q), unit_last_stride(k)
    if num_tokens == 0:
        return q, k
    positions, cos, sin = positions.contiguous(), cos.contiguous(), sin.contiguous()
    # No FMA contraction on GPUs: torch computes x1 * cos - x2 * sin as separately rounded ops; so do we.
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HALF=half, HALF_PAD=triton.next_power_of_2(half),
        enable_fp_fusion=False)
    return q, k
