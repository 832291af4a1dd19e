"""Filters by load: prefer endpoints that are not saturated (queue or KV cache over a threshold), refusing a
sheddable request (429) when all are, rather than queueing it behind critical traffic; and, for the fair
queue's dispatch, prefer endpoints with a free place in their running batch."""
from __future__ import annotations

import numpy as np

from ...datastore.load_table import LoadTable
from ..framework import Context, Filter
from ..registry import register_filter
from ..request import RoutingError


def saturated(table: LoadTable, rows: np.ndarray, queue_threshold: float, kv_threshold: float) -> np.ndarray:
    """Per row: waiting requests or KV-cache usage at or over its threshold."""
    return (table.queue[rows] >= queue_threshold) | (table.kv_usage[rows] >= kv_threshold)


@register_filter("saturation")
class SaturationFilter(Filter):
    """Keeps the unsaturated endpoints, or all when every one is saturated (the request queues there), except
    that a sheddable request is then refused. `preferUnsaturated: false` only sheds: round-robin's admission."""

    def filter(self, ctx: Context, rows: np.ndarray) -> np.ndarray:
        if not rows.size:
            return rows
        busy = saturated(ctx.table, rows, float(self.parameters.get("queueThreshold", self.handle.queue_threshold)),
                         float(self.parameters.get("kvThreshold", self.handle.kv_threshold)))
        if not busy.all():
            return rows[~busy] if self.parameters.get("preferUnsaturated", True) else rows
        if ctx.request.sheddable:
            raise RoutingError(429, f"every endpoint serving `{ctx.request.model}` is saturated; "
                                    "sheddable requests are refused until load drops")
        return rows


@register_filter("free-slot")
class FreeSlotFilter(Filter):
    """When the cycle asks (Context.free_slot), the endpoints with room in their running batch, if any."""

    def filter(self, ctx: Context, rows: np.ndarray) -> np.ndarray:
        if ctx.free_slot and (roomy := rows[~ctx.table.batch_full[rows]]).size:
            return roomy
        return rows
