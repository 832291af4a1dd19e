"""Batched multi-LoRA: every token adds the delta of its own adapter to a projection's base output.

Tokens are grouped by adapter slot once per step (`LoRAContext.build`); each projection then runs,
per adapter present, two skinny matmuls on that adapter's rows, trimmed to its rank, and adds the
result in place. A group that is one contiguous run of rows (one sequence, or a batch sorted by
adapter) is a view, with no gather or scatter. On the CPU this beat, at every batch size from 1 to
2048 tokens, both a per-token gather of the slot matrices and one dense matmul over all slots
masked per token (see benchmarks/bench_lora_delta.py).

On CUDA, when triton is installed, `apply` runs the segmented kernels of triton_lora.py instead.

Our fused projections are the concatenation of PEFT's: qkv_proj = [q; k; v], gate_up_proj = [gate; up];
each part gets its own delta, and a part the adapter does not target is skipped (it is zero). Where the
checkpoint itself is fused (Phi-3), so are its adapters: qkv_proj and gate_up_proj are one part each.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..config import FUSED_WEIGHTS, ModelSpec
from ..device_copy import to_device
from .adapter import module_shapes
from .pool import LoRAPool

if TYPE_CHECKING:
    from .triton_ops import SegmentPlan, TokenPlan

Rows = slice | torch.Tensor  # a contiguous run of rows, or their indices


def fused_parts(spec: ModelSpec) -> dict[str, list[tuple[str, int, int]]]:
    """Our projection name -> [(PEFT module, first output column, width)] in output order."""
    shapes = module_shapes(spec)
    parts: dict[str, list[str]] = {"o_proj": ["o_proj"], "down_proj": ["down_proj"]}
    for ours, theirs, _ in sorted(FUSED_WEIGHTS, key=lambda w: w[2]):
        parts.setdefault(ours, []).append(theirs if not spec.fused_checkpoint else ours)
    parts = {ours: list(dict.fromkeys(names)) for ours, names in parts.items()}  # a fused checkpoint: one part
    parts = {ours: names for ours, names in parts.items() if all(n in shapes for n in names)}  # MoE: attention only
    layout = {}
    for ours, names in parts.items():
        offset, layout[ours] = 0, []
        for name in names:
            width = shapes[name][1]
            layout[ours].append((name, offset, width))
            offset += width
    return layout


class LoRAContext:
    """One step's routing of tokens to adapter slots; the model calls `apply` after each projection."""

    def __init__(self, pool: LoRAPool, groups: list[tuple[int, Rows]], kernel_plan=None) -> None:
        """`kernel_plan`: a ready plan for the Triton kernels (a CUDA-graph step's TokenPlan); by default
        one is built from `groups` on CUDA, and the torch path runs elsewhere."""
        self.pool = pool
        self.groups = groups  # (slot, rows) for every slot but 0 present in the batch
        self.parts = fused_parts(pool.spec)
        # Snapshot: the pool may reassign slots between steps, never during one.
        self.ranks = {slot: pool.slot_rank[slot] for slot, _ in groups}
        self.targets = {slot: pool.slot_targets[slot] for slot, _ in groups}
        if kernel_plan is None and pool.device.type == "cuda":
            kernel_plan = self._kernel_plan()
        self.kernel_plan: SegmentPlan | TokenPlan | None = kernel_plan

    @classmethod
    def build(cls, pool: LoRAPool, token_slots: Sequence[int] | torch.Tensor) -> LoRAContext | None:
        """Group the step's tokens by slot; None when no token uses an adapter (the model skips LoRA)."""
        slots = torch.as_tensor(token_slots, dtype=torch.long, device="cpu")
        groups: list[tuple[int, Rows]] = []
        for slot in torch.unique(slots).tolist():
            if slot == 0:
                continue
            if not 0 < slot <= pool.max_loras or pool.slot_rank[slot] == 0:
                raise ValueError(f"token routed to slot {slot}, which holds no adapter")
            index = (slots == slot).nonzero().squeeze(1)
            first, last = int(index[0]), int(index[-1])
            contiguous = last - first + 1 == index.numel()
            groups.append((slot, slice(first, last + 1) if contiguous else to_device(index, pool.device)))
        return cls(pool, groups) if groups else None

    def _kernel_plan(self) -> SegmentPlan | None:
        """Tokens sorted into per-slot segments for the Triton kernels, which serve every adapter of the step
        with one shrink and one expand launch per projection part (see triton_lora.py)."""
        try:
            from .triton_ops import SegmentPlan
        except ImportError:  # triton is optional (the `gpu` extra): the torch path below still works
            return None
        return SegmentPlan.build(self.pool, self.groups, self.targets)

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        """out[t] += delta of token t's adapter on `module` (our name: qkv_proj, o_proj, gate_up_proj, down_proj)."""
        a, b = self.pool.lora_a[layer], self.pool.lora_b[layer]
        parts = self.parts[module]
        if self.kernel_plan is not None:
            from .triton_ops import add_lora
            return add_lora(out, x, a, b, parts, self.kernel_plan, layer)
        for slot, rows in self.groups:
            targets, rank = self.targets[slot], self.ranks[slot]
            xs = None
            for name, offset, width in parts:
                if (layer, name) not in targets:
                    continue
                if xs is None:  # gather once per group, shared by q, k and v
                    xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
                delta = (xs @ a[name][slot, :rank].T) @ b[name][slot, :, :rank].T
                columns = out[:, offset:offset + width]
                if isinstance(rows, slice):
                    columns[rows].add_(delta)
                else:
                    columns.index_add_(0, rows, delta)
        return out

    def delta(self, x: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        """The deltas alone (zero rows for base-model tokens), for tests and debugging."""
        width = sum(w for _, _, w in self.parts[module])
        return self.apply(x.new_zeros(x.shape[0], width), x, layer, module)
