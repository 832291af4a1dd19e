"""Triton kernels for batched multi-LoRA: segmented shrink (x @ A.T) and expand (+= s @ B.T).

The step's adapter tokens are sorted by slot into segments (one per adapter present; slot-0 tokens
are left out and untouched). A program takes one segment, a tile of its tokens and a tile of the
output columns, and multiplies by that segment's slot of the pool's stacked matrices
(A [slots, max_rank, in], B [slots, out, max_rank]), trimmed to the segment's rank for this layer and
module (0 when the adapter does not target it: the program exits at once). This is what punica's SGMV
does: one launch serves every adapter, where the torch path runs two matmuls per adapter per module.
The shrink result stays fp32 between the two kernels; the expand adds into the base output in place.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..device_copy import on_device, to_device
from ..triton_utils import MIN_DOT, must_upcast, unit_last_stride
from .pool import LoRAPool


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, s_ptr, tokens_ptr, seg_start_ptr, seg_slot_ptr, seg_rank_ptr, in_features,
                   stride_xt, stride_as, stride_ar, stride_st,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    seg = tl.program_id(0)
    rank = tl.load(seg_rank_ptr + seg)
    first = tl.load(seg_start_ptr + seg) + tl.program_id(1) * BLOCK_T
    end = tl.load(seg_start_ptr + seg + 1)
    r0 = tl.program_id(2) * BLOCK_R
    if (first >= end) | (r0 >= rank):
        return
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    idx = first + tl.arange(0, BLOCK_T)  # positions in the sorted order: rows of s
    t_ok = idx < end
    tokens = tl.load(tokens_ptr + idx, mask=t_ok, other=0).to(tl.int64)  # rows of x
    ranks = r0 + tl.arange(0, BLOCK_R)
    r_ok = ranks < rank
    acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < in_features
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + ranks[:, None] * stride_ar + ks[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        else:
            x = x.to(a.dtype)
        acc += tl.dot(x, tl.trans(a), input_precision="ieee")
    tl.store(s_ptr + idx[:, None] * stride_st + ranks[None, :], acc, mask=t_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(s_ptr, b_ptr, out_ptr, tokens_ptr, seg_start_ptr, seg_slot_ptr, seg_rank_ptr, out_features,
                   stride_st, stride_bs, stride_bo, stride_ot,
                   BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr):
    seg = tl.program_id(0)
    rank = tl.load(seg_rank_ptr + seg)
    first = tl.load(seg_start_ptr + seg) + tl.program_id(1) * BLOCK_T
    end = tl.load(seg_start_ptr + seg + 1)
    if (first >= end) | (rank == 0):
        return
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    idx = first + tl.arange(0, BLOCK_T)
    t_ok = idx < end
    tokens = tl.load(tokens_ptr + idx, mask=t_ok, other=0).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = cols < out_features
    acc = tl.zeros([BLOCK_T, BLOCK_O], tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        r_ok = ranks < rank
        s = tl.load(s_ptr + idx[:, None] * stride_st + ranks[None, :], mask=t_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + cols[None, :] * stride_bo + ranks[:, None],
                    mask=r_ok[:, None] & o_ok[None, :], other=0.0)  # [R, O]: B transposed on the fly
        if UPCAST:
            b = b.to(tl.float32)
        else:
            s = s.to(b.dtype)
        acc += tl.dot(s, b, input_precision="ieee")
    target = out_ptr + tokens[:, None] * stride_ot + cols[None, :]
    mask = t_ok[:, None] & o_ok[None, :]
    base = tl.load(target, mask=mask, other=0.0).to(tl.float32)
    tl.store(target, (base + acc).to(out_ptr.dtype.element_ty), mask=mask)


@dataclass
class SegmentPlan:
    """One step's adapter tokens sorted into per-slot segments, on the device, built once per step."""
    tokens: torch.Tensor  # [N] int32 rows of the batch, grouped by slot
    seg_start: torch.Tensor  # [S + 1] int32
    seg_slot: torch.Tensor  # [S] int64
    seg_rank: dict[tuple[int, str], torch.Tensor]  # (layer, PEFT module) -> [S] int32 rank, 0 = not targeted
    targeted: frozenset[tuple[int, str]]  # (layer, module) pairs some segment's adapter targets
    longest: int  # tokens in the largest segment (the grid's second dimension)

    @classmethod
    def build(cls, pool: LoRAPool, groups: Sequence[tuple[int, slice | torch.Tensor]],
              targets: dict[int, frozenset[tuple[int, str]]]) -> SegmentPlan:
        """From LoRAContext's snapshot: groups of (slot, rows), and the (layer, module) pairs each slot targets."""
        device = pool.device
        rows = [torch.arange(r.start, r.stop) if isinstance(r, slice) else r.cpu() for _, r in groups]
        starts = [0]
        for r in rows:
            starts.append(starts[-1] + len(r))
        seg_slot = on_device([slot for slot, _ in groups], torch.long, device)
        ranks = pool.rank_table.index_select(1, seg_slot)  # [modules, S], read on the device
        return cls(tokens=to_device(torch.cat(rows).to(torch.int32), device),
                   seg_start=on_device(starts, torch.int32, device),
                   seg_slot=seg_slot,
                   seg_rank=dict(zip(pool.module_keys, ranks.unbind(0))),
                   targeted=frozenset().union(*(targets[slot] for slot, _ in groups)),
                   longest=max(len(r) for r in rows))

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()


class TokenPlan:
    """The plan of a decode step replayed from a CUDA graph: one segment per token (a decode has one),
    on static device buffers, so the launches never change shape. The caller writes each token's slot
    into `seg_slot` (0: no adapter, and padding); `refresh`, run inside the step, looks every token's rank
    on every module up in the pool's device rank table. Same interface as SegmentPlan."""

    def __init__(self, pool: LoRAPool, token_slots: torch.Tensor) -> None:
        num_tokens, device = token_slots.numel(), token_slots.device
        self.pool = pool
        self.tokens = torch.arange(num_tokens, dtype=torch.int32, device=device)
        self.seg_start = torch.arange(num_tokens + 1, dtype=torch.int32, device=device)
        self.seg_slot = token_slots  # int64 [N], a view of the caller's static buffer
        self.token_ranks = torch.zeros(len(pool.module_keys), num_tokens, dtype=torch.int32, device=device)
        self.seg_rank = dict(zip(pool.module_keys, self.token_ranks.unbind(0)))
        self.targeted = frozenset(pool.module_keys)  # which modules the step needs is unknown at capture
        self.longest = 1

    def refresh(self) -> None:
        torch.index_select(self.pool.rank_table, 1, self.seg_slot, out=self.token_ranks)

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()


def lora_shrink(x: torch.Tensor, a: torch.Tensor, plan: SegmentPlan | TokenPlan, seg_rank: torch.Tensor, *,
                block_t: int = 16, block_r: int = 16, block_k: int = 64) -> torch.Tensor:
    """s[i] = x[tokens[i]] @ A[slot(i), :rank].T as fp32 [N, max_rank] (columns past a segment's rank unset)."""
    x = unit_last_stride(x)
    a = unit_last_stride(a)
    s = torch.empty(plan.num_tokens, a.shape[1], dtype=torch.float32, device=x.device)
    block_r = max(block_r, MIN_DOT)
    grid = (len(plan.seg_slot), triton.cdiv(plan.longest, block_t), triton.cdiv(a.shape[1], block_r))
    _shrink_kernel[grid](x, a, s, plan.tokens, plan.seg_start, plan.seg_slot, seg_rank, x.shape[1],
                         x.stride(0), a.stride(0), a.stride(1), s.stride(0),
                         BLOCK_T=max(block_t, MIN_DOT), BLOCK_R=block_r, BLOCK_K=max(block_k, MIN_DOT),
                         UPCAST=must_upcast(a))
    return s


def lora_expand(out: torch.Tensor, s: torch.Tensor, b: torch.Tensor, plan: SegmentPlan | TokenPlan,
                seg_rank: torch.Tensor, *, block_t: int = 16, block_o: int = 64, block_r: int = 16) -> None:
    """out[tokens[i]] += s[i, :rank] @ B[slot(i), :, :rank].T in place; `out` may be a column slice."""
    if out.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("lora_expand needs unit stride along the last dimension of out and B")
    block_o = max(block_o, MIN_DOT)
    grid = (len(plan.seg_slot), triton.cdiv(plan.longest, block_t), triton.cdiv(b.shape[1], block_o))
    _expand_kernel[grid](s, b, out, plan.tokens, plan.seg_start, plan.seg_slot, seg_rank, b.shape[1],
                         s.stride(0), b.stride(0), b.stride(1), out.stride(0),
                         BLOCK_T=max(block_t, MIN_DOT), BLOCK_O=block_o, BLOCK_R=max(block_r, MIN_DOT),
                         UPCAST=must_upcast(b))


def add_lora(out: torch.Tensor, x: torch.Tensor, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
             parts: Sequence[tuple[str, int, int]], plan: SegmentPlan | TokenPlan, layer: int) -> torch.Tensor:
    """LoRAContext.apply on the kernels: out[:, part columns] += each token's adapter delta, part by part."""
    for name, offset, width in parts:
        if (layer, name) not in plan.targeted:
            continue  # no adapter of this step touches it: skip two launches
        seg_rank = plan.seg_rank[(layer, name)]
        s = lora_shrink(x, a[name], plan, seg_rank)
        lora_expand(out[:, offset:offset + width], s, b[name], plan, seg_rank)
    return out
