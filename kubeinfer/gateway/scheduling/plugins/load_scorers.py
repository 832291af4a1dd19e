"""Scorers by load, each min-max normalised over the candidates or an absolute share:
  queue     fewer waiting requests (counting the gateway's own dispatches since the last scrape)
  active    fewer running requests: an engine that admits everything has no queue
  kv_cache  more free KV cache"""
from __future__ import annotations

import numpy as np

from ..framework import Context, Scorer
from ..registry import register_scorer


def fewer_is_better(values: np.ndarray) -> np.ndarray:
    """Min-max normalised over the candidates: the least loaded scores 1, the most loaded 0."""
    low, high = values.min(), values.max()
    return np.ones(len(values)) if high == low else (high - values) / (high - low)


@register_scorer("queue")
class QueueScorer(Scorer):
    def score(self, ctx: Context, rows: np.ndarray) -> np.ndarray:
        return fewer_is_better(ctx.table.queue[rows])


@register_scorer("active")
class ActiveScorer(Scorer):
    def score(self, ctx: Context, rows: np.ndarray) -> np.ndarray:
        return fewer_is_better(ctx.table.active[rows])


@register_scorer("kv_cache")
class KVCacheScorer(Scorer):
    def score(self, ctx: Context, rows: np.ndarray) -> np.ndarray:
        return np.maximum(0.0, 1.0 - ctx.table.kv_usage[rows])
