"""Triton dequantize-and-multiply for weight-only int8/int4 and fp8 (e4m3) linear layers on the GPU: the
weights stay quantized in memory (int8 and fp8: one byte per weight; int4: two per byte, the even column in the
low nibble) and each tile is widened, offset by its group's zero point and scaled inside the kernel, so a
decode step reads a half (int8, fp8) or a quarter (int4) of the bytes a bf16 weight takes.

fp8 weights are held as their raw e4m3fn bits (uint8) and decoded with integer ops (`_e4m3_to_float`: sign,
4-bit exponent with bias 7, 3-bit mantissa; exponent 0 is subnormal, 0x7F/0xFF NaN), which Triton's CPU
interpreter runs as well as a GPU, so the kernel is checked here; the decoded value is exact in float32.

y[m, n] = sum_k x[m, k] * (q[n, k] - zero[n, k // G]) * scale[n, k // G] (+ bias[n]); q signed, zero signed
(0 when symmetric). Accumulation in fp32; checked against torch under TRITON_INTERPRET=1
(tests/engine/test_triton_int_matmul.py). Where each K tile lies in one group (per channel, or groups of 16 or more
columns in powers of two), the dot multiplies the exact integers and each tile's sums are scaled: a bf16 dot
on the scaled weight rounded it to 8 significant bits, 3-5% of the outputs of an int8 layer off by 0.2-0.4
on the first GPU run (2026-11-27)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....triton_utils import MIN_DOT, group_tile, must_upcast, unit_last_stride


@triton.jit
def _e4m3_to_float(bits):
    """e4m3fn bits (any integer type, 0..255) to float32: normal 2^(e-7) * (1 + m/8) built as float32's own
    fields (exponent e - 7 + 127, mantissa m << 20); subnormal (e == 0) m * 2^-9; 0x7F and 0xFF NaN. The sign
    is float32's sign bit, set with integer ops: a float negation is `0.0 - x` in Triton before 3.7 (-0.0 came
    out +0.0 on the GPU), and integer ops and bitcasts are exact in every compiler and the interpreter."""
    b = bits.to(tl.int32) & 255
    exponent, mantissa = (b >> 3) & 15, b & 7
    fields = ((exponent + 120) << 23) | (mantissa << 20)
    fields = tl.where((b & 127) == 127, 0x7FC00000, fields)  # float32's quiet NaN
    subnormal = (mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # exact, >= +0.0
    fields = tl.where(exponent == 0, subnormal, fields)
    return (fields | ((b >> 7) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _decode_e4m3_kernel(bits_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < n
    tl.store(out_ptr + offsets, _e4m3_to_float(tl.load(bits_ptr + offsets, mask=ok, other=0)), mask=ok)


def decode_e4m3(bits: torch.Tensor) -> torch.Tensor:
    """The kernel's decoder on its own (for tests): uint8 e4m3fn bits to float32."""
    flat = bits.reshape(-1).contiguous()
    out = torch.empty(flat.shape, dtype=torch.float32, device=bits.device)
    _decode_e4m3_kernel[(triton.cdiv(flat.numel(), 256),)](flat, out, flat.numel(), BLOCK=256)
    return out.reshape(bits.shape)


@triton.jit
def _int_matmul_kernel(x_ptr, q_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_qn,
                       stride_sn, stride_om, GROUP: tl.constexpr, INT4: tl.constexpr, FP8: tl.constexpr,
                       HAS_ZERO: tl.constexpr,
                       HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, ONE_GROUP: tl.constexpr = False):
    """ONE_GROUP: each K tile lies inside one group (triton_utils.group_tile), so the dot multiplies the exact
    values q - zero (|.| <= 255; e4m3 values: exact in bf16 and fp16) and the tile's fp32 sums are scaled per
    column. Otherwise each weight is scaled first, then rounded to x's dtype for a half-precision dot."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = col_ok[:, None] & k_ok[None, :]
        if INT4:  # byte k // 2 of a row holds columns k (low nibble) and k + 1 (high), offset by 8 to unsigned
            byte = tl.load(q_ptr + cols[:, None] * stride_qn + (ks // 2)[None, :], mask=w_mask, other=0).to(tl.int32)
            q = ((byte >> ((ks % 2) * 4)[None, :]) & 15) - 8
        elif FP8:  # e4m3fn bits, decoded to float32
            q = _e4m3_to_float(tl.load(q_ptr + cols[:, None] * stride_qn + ks[None, :], mask=w_mask, other=0))
        else:
            q = tl.load(q_ptr + cols[:, None] * stride_qn + ks[None, :], mask=w_mask, other=0).to(tl.int32)
        group = ks // GROUP
        if HAS_ZERO:  # integers: exact
            q -= tl.load(zero_ptr + cols[:, None] * stride_sn + group[None, :], mask=w_mask, other=0).to(tl.int32)
        w = q.to(tl.float32)  # [BLOCK_N, BLOCK_K]
        if ONE_GROUP:
            scale = tl.load(scale_ptr + cols * stride_sn + k0 // GROUP, mask=col_ok, other=0.0).to(tl.float32)
            if UPCAST:
                part = tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w.to(x.dtype)))
            acc += part * scale[None, :]
        else:
            w = w * tl.load(scale_ptr + cols[:, None] * stride_sn + group[None, :], mask=w_mask,
                            other=0.0).to(tl.float32)
            if UPCAST:
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def int_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               group_size: int, int4: bool, bias: torch.Tensor | None = None, fp8: bool = False) -> torch.Tensor:
    """x [..., K] times the weight held as qweight (int8 [N, K]; uint8 [N, K / 2] for int4; uint8 e4m3fn bits
    [N, K] for fp8), scale [N, groups] and zero [N, groups] (int8, or None: symmetric); returns [..., N] in x's
    dtype."""
    shape = x.shape
    x2 = unit_last_stride(x.reshape(-1, shape[-1]))
    m, k = x2.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = max(MIN_DOT, min(64, triton.next_power_of_2(m)))
    block_k, one_group = group_tile(group_size, k)  # a tile spanning groups looks each column's scale up by column
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int_matmul_kernel[grid](
        x2, qweight, scale, zero if zero is not None else scale, bias if bias is not None else scale, out, m, n, k,
        x2.stride(0), qweight.stride(0), scale.stride(0), out.stride(0), GROUP=group_size, INT4=int4,
        FP8=fp8, HAS_ZERO=zero is not None, HAS_BIAS=bias is not None, UPCAST=must_upcast(x2), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, ONE_GROUP=one_group)
    return out.reshape(*shape[:-1], n)
