"""Pickers: choose the endpoint, and the fallbacks a proxy or Envoy retries on, from the candidates' totals.
  max-score    the highest total; noise far below any real difference orders equal totals, so a burst
               spreads over equal pods (seeded by the picker's rng)
  round-robin  a per-model rotation, blind to scores: what a plain Kubernetes Service would do, the
               baseline the routing benchmark measures against"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..framework import Context, Picker, PluginHandle
from ..registry import register_picker

TIE_BREAK = 1e-9  # random noise this small only orders equal totals


def best_first(keys: np.ndarray, count: int) -> np.ndarray:
    """Positions of the `count` highest keys, highest first, without sorting them all."""
    if len(keys) > count:
        top = np.argpartition(-keys, count - 1)[:count]
        return top[np.argsort(-keys[top])]
    return np.argsort(-keys)


@register_picker("max-score")
class MaxScorePicker(Picker):
    def pick(self, ctx: Context, rows: np.ndarray, totals: np.ndarray, count: int) -> np.ndarray:
        return best_first(totals + TIE_BREAK * self.handle.noise.random(len(rows)), count)


@register_picker("round-robin")
class RoundRobinPicker(Picker):
    uses_scores = False

    def __init__(self, parameters: dict[str, Any] | None = None, handle: PluginHandle | None = None) -> None:
        super().__init__(parameters, handle)
        self._turns: dict[str, int] = {}  # rotation position, per model

    def pick(self, ctx: Context, rows: np.ndarray, totals: np.ndarray, count: int) -> np.ndarray:
        model = ctx.request.model
        turn = self._turns.get(model, 0)
        self._turns[model] = turn + 1
        return (turn + np.arange(min(count, len(rows)))) % len(rows)
