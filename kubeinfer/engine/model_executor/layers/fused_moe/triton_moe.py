"""The fused experts for the GPU: the step's (token, choice) pairs sorted by expert and each expert's group
padded to a whole tile (`align_by_expert`, torch ops with static shapes, so a CUDA graph can capture them),
then two grouped GEMMs: one over every expert's gate/up weights (bias in its epilogue), the activation, one
over the down weights with the bias and the routing weight applied in the epilogue. Each program computes a
BLOCK_M x BLOCK_N tile whose rows all belong to one expert; padding rows read nothing and write nothing.
Finally the k results of each token are summed.

Maths is fp32 with ieee dots in the interpreter and for fp32 weights; half precision feeds tensor cores.

Kept-quantized experts (`quantized`, int_experts.py): B is read as int8, as e4m3 bits (fp8) or as two int4 per
byte, and each tile is widened, offset by its group's zero and scaled in the kernel (per expert, output row
and group of K), as triton_int_matmul.py does for a dense layer; the float stacks are then shapes only. A K tile
inside one group (triton_utils.group_tile) multiplies the exact q - zero and scales the dot's fp32 sums, so a
bf16 dot never rounds a scaled weight.

`input_quant` (W8A8 experts, expert_input_quant.py) quantizes in torch what the kernels read: the hidden states once
(or, with a static scale per expert, one row per pair, read with A_ROWS_PER_TOKEN 1), and the materialized
activation's pair rows before the down GEMM.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ....triton_utils import MIN_DOT, group_tile, must_upcast
from ..quantization.triton_int_matmul import _e4m3_to_float
from .activation import clamped_swiglu, silu_and_mul


class QuantizedExperts(NamedTuple):
    """One projection's kept experts: qweight [E, N, K] int8 (fp8: uint8 e4m3 bits; int4: uint8 [E, N, K / 2]),
    scale [E, N, groups] float32, zero [E, N, groups] int8 or None."""
    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int
    int4: bool
    fp8: bool


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                         N, K, num_pairs, stride_am, stride_be, stride_bn, stride_cm, stride_bias_e,
                         scale_ptr, zero_ptr, stride_se, stride_sn,
                         A_ROWS_PER_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         QUANT: tl.constexpr = False, INT4: tl.constexpr = False, FP8: tl.constexpr = False,
                         HAS_ZERO: tl.constexpr = False, GROUP: tl.constexpr = 1, ONE_GROUP: tl.constexpr = False):
    """C[pair] = A[row of pair] @ B[expert].T (+ bias[expert]) (* weight[pair]) for each tile of sorted pairs.
    A's row is the token (pair // top_k) when A_ROWS_PER_TOKEN is top_k (the first GEMM reads the hidden
    states), the pair itself when it is 1 (the second reads the first's output)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + rows)
    row_ok = pairs < num_pairs
    a_rows = (pairs // A_ROWS_PER_TOKEN).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    b_base = b_ptr + expert * stride_be
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        if QUANT:  # [BLOCK_K, BLOCK_N] of expert's values, dequantized: (q - zero) * scale of (row, k // GROUP)
            kk = k0 + ks
            if INT4:  # byte k // 2 holds columns k (low nibble) and k + 1 (high), offset by 8 to unsigned
                byte = tl.load(b_base + cols[None, :] * stride_bn + (kk // 2)[:, None], mask=b_mask, other=0)
                q = (((byte.to(tl.int32) >> ((kk % 2) * 4)[:, None]) & 15) - 8).to(tl.float32)
            elif FP8:
                q = _e4m3_to_float(tl.load(b_base + cols[None, :] * stride_bn + kk[:, None], mask=b_mask, other=0))
            else:
                q = tl.load(b_base + cols[None, :] * stride_bn + kk[:, None], mask=b_mask, other=0).to(tl.float32)
            s_off = expert * stride_se + cols[None, :] * stride_sn + (kk // GROUP)[:, None]
            if HAS_ZERO:  # small integers: exact
                q -= tl.load(zero_ptr + s_off, mask=b_mask, other=0).to(tl.float32)
            if ONE_GROUP:  # the tile inside one group: the dot on q - zero, exact in a.dtype; its sums scaled
                b = q
            else:
                b = q * tl.load(scale_ptr + s_off, mask=b_mask, other=0.0)
            if not UPCAST:
                b = b.to(a.dtype)
        else:
            b = tl.load(b_base + cols[None, :] * stride_bn + (k0 + ks)[:, None], mask=b_mask, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if QUANT and ONE_GROUP:
            scale = tl.load(scale_ptr + expert * stride_se + cols * stride_sn + k0 // GROUP, mask=col_ok, other=0.0)
            acc += tl.dot(a, b, input_precision="ieee") * scale.to(tl.float32)[None, :]
        else:
            acc += tl.dot(a, b, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_e + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted pair ids [P] padded with the sentinel T*k, the expert of each BLOCK_M tile [P / block_m], the
    padded length [1]) where P = T*k + E*(block_m - 1) bounds any padding: fixed by the shapes alone."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    ends = torch.cumsum(counts, 0)
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    rank = torch.arange(num_pairs, device=device) - (ends - counts)[experts_sorted]
    capacity = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[(padded_ends - padded)[experts_sorted] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, capacity, block_m, device=device)
    expert_ids = torch.searchsorted(padded_ends, tile_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, padded_ends[-1:].to(torch.int32)


def _gemm(a, b, out, bias, weights, sorted_ids, expert_ids, num_padded, rows_per_token, block_m, quant=None):
    """b: the float stack [E, N, K] (its shape only when `quant` holds the kept weights)."""
    n, k = b.shape[1], b.shape[2]
    block_n = min(64, max(MIN_DOT, triton.next_power_of_2(n)))
    block_k, one_group = min(64, max(MIN_DOT, triton.next_power_of_2(k))), False
    if quant is not None:
        block_k, one_group = group_tile(quant.group_size, k)
    grid = (expert_ids.shape[0] * triton.cdiv(n, block_n),)
    q = {} if quant is None else dict(QUANT=True, INT4=quant.int4, FP8=quant.fp8, HAS_ZERO=quant.zero is not None,
                                      GROUP=quant.group_size, ONE_GROUP=one_group)
    values = b if quant is None else quant.qweight
    scale = values if quant is None else quant.scale
    zero = scale if quant is None or quant.zero is None else quant.zero
    _grouped_gemm_kernel[grid](
        a, values, out, bias if bias is not None else values, weights if weights is not None else out, sorted_ids,
        expert_ids, num_padded, n, k, out.shape[0], a.stride(0), values.stride(0), values.stride(1), out.stride(0),
        bias.stride(0) if bias is not None else 0, scale, zero, scale.stride(0), scale.stride(1),
        A_ROWS_PER_TOKEN=rows_per_token, HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None,
        UPCAST=must_upcast(a), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **q)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None, swiglu_limit: float | None = None,
                  swiglu_alpha: float = 1.702, block_m: int | None = None, input_quant=None,
                  quantized: dict[str, QuantizedExperts] | None = None) -> torch.Tensor:
    """As grouped.grouped_experts: x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; topk_* [T, k] -> [T, H].
    `quantized` {"gate_up", "down"}: the kept weights the kernels read (gate_up and down then give shapes)."""
    num_tokens, top_k = topk_ids.shape
    quantized = quantized or {}
    if x.stride(-1) != 1 or (not quantized and (gate_up.stride(-1) != 1 or down.stride(-1) != 1)):
        raise ValueError("fused_experts needs a contiguous last dimension on x and the expert weights")
    if num_tokens == 0:
        return torch.zeros_like(x)
    if block_m is None:  # decode-sized steps: most experts get a token or two, so small tiles pad least
        block_m = MIN_DOT if num_tokens * top_k <= 64 * gate_up.shape[0] else 64
    sorted_ids, expert_ids, num_padded = align_by_expert(topk_ids, gate_up.shape[0], block_m)
    pairs = num_tokens * top_k
    h = torch.empty(pairs, gate_up.shape[1], dtype=x.dtype, device=x.device)
    a, rows_per_token = x, top_k
    if input_quant is not None:
        experts = topk_ids.reshape(-1)
        a = input_quant.hidden(x)
        if a is None:  # a static scale per expert: pair p's row is token p // top_k, quantized for its expert
            a, rows_per_token = input_quant.hidden_rows(x.repeat_interleave(top_k, dim=0), experts), 1
    _gemm(a, gate_up, h, gate_up_bias, None, sorted_ids, expert_ids, num_padded, rows_per_token, block_m,
          quantized.get("gate_up"))
    act = silu_and_mul(h) if swiglu_limit is None else clamped_swiglu(swiglu_alpha, swiglu_limit)(h)
    if input_quant is not None:
        act = input_quant.intermediate(act, experts)
    out = torch.empty(pairs, down.shape[1], dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _gemm(act.contiguous(), down, out, down_bias, weights, sorted_ids, expert_ids, num_padded, 1, block_m,
          quantized.get("down"))
    return out.view(num_tokens, top_k, -1).sum(dim=1)
