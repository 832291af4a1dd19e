"""Filters that decide which endpoints may take the request at all, and answer the client when none may:
ready (scraped recently, not failing), the data plane's subset hint, the endpoints a retry already tried,
and those that serve the model (loaded by their own /v1/models, else assigned it: they load it).
In this order they give today's answers: 503 none ready, 503 none of the subset ready, 503 no other
(untried) endpoint, 503 known model but none ready serves it, 404 unknown model."""
from __future__ import annotations

import time

import numpy as np

from ..framework import Context, Filter
from ..registry import register_filter
from ..request import RoutingError

EXCLUDED = "admission.excluded"  # Context.state: the rows the exclude filter took out


@register_filter("ready")
class ReadyFilter(Filter):
    """Scraped within `staleAfter` seconds and fewer than `maxFailures` failed scrapes in a row."""

    def filter(self, ctx: Context, rows: np.ndarray) -> np.ndarray:
        stale_after = float(self.parameters.get("staleAfter", self.handle.stale_after))
        max_failures = int(self.parameters.get("maxFailures", self.handle.max_failures))
        ready = rows[ctx.table.ready(time.monotonic(), stale_after, max_failures)[rows]]
        if not ready.size and ctx.request.subset is None:  # with a subset hint, the subset filter answers
            raise RoutingError(503, "no engine endpoint is ready")
        return ready


@register_filter("subset")
class SubsetFilter(Filter):
    """Only the addresses of the data plane's subset hint, when the request carries one."""

    def filter(self, ctx: Context, rows: np.ndarray) -> np.ndarray:
        subset = ctx.request.subset
        if subset is None:
            return rows
        kept = rows[ctx.table.addresses(subset)[rows]]
        if not kept.size:
            raise RoutingError(503, f"none of the {len(subset)} endpoints of the subset hint is ready")
        return kept


@register_filter("exclude")
class ExcludeFilter(Filter):
    """Not the endpoints this request already tried (a retry picks again)."""

    def filter(self, ctx: Context, rows: np.ndarray) -> np.ndarray:
        if not ctx.request.exclude:
            return rows
        tried = ctx.table.addresses(ctx.request.exclude)[rows]
        ctx.state[EXCLUDED] = rows[tried]
        return rows[~tried]


@register_filter("serves-model")
class ServesModelFilter(Filter):
    """Endpoints with the model (base or adapter) loaded, else those it is assigned to."""

    def filter(self, ctx: Context, rows: np.ndarray) -> np.ndarray:
        table, model = ctx.table, ctx.request.model
        among = np.zeros(len(table.endpoints), dtype=bool)
        among[rows] = True
        serving = np.flatnonzero(table.serving(model, among))
        if serving.size:
            return serving
        excluded = ctx.state.get(EXCLUDED)
        if excluded is not None and excluded.size:
            among[excluded] = True
            if table.serving(model, among).any():
                raise RoutingError(503, f"no other ready endpoint serves model `{model}` right now")
        if table.knows(model):
            raise RoutingError(503, f"no ready endpoint serves model `{model}` right now")
        raise RoutingError(404, f"The model `{model}` does not exist.")
