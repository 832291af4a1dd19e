"""LoRA affinity: 1.0 adapter active, 0.8 loaded with a free adapter slot, 0.6 adapter waiting, 0 otherwise
(an endpoint that would have to swap an adapter out). A base-model request scores every endpoint alike."""
from __future__ import annotations

import numpy as np

from ..framework import Context, Scorer
from ..registry import register_scorer


@register_scorer("lora")
class LoRAScorer(Scorer):
    def score(self, ctx: Context, rows: np.ndarray) -> np.ndarray:
        model, table = ctx.request.model, ctx.table
        if not model:
            return np.ones(len(rows))
        active = (table.base.mask(model) | table.running_adapters.mask(model))[rows]
        free_slot = (table.loaded.mask(model) & table.free_adapter_slot)[rows]
        waiting = table.waiting_adapters.mask(model)[rows]
        return np.where(active, 1.0, np.where(free_slot, 0.8, np.where(waiting, 0.6, 0.0)))
