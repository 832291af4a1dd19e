"""The scheduling framework's interfaces, in the Inference Extension endpoint picker's terms.

One scheduling cycle per request: a ProfileHandler chooses which profile(s) run; a profile's Filters narrow
the candidate endpoints, its Scorers give each survivor a score in [0, 1], summed with the profile's weights,
and its Picker chooses the endpoint (and fallbacks) from the totals. After the choice, every plugin of the
profile that defines `pre_request` hears which endpoint was chosen (the prefix scorer remembers where the
prompt went). Candidates are rows of the pool's LoadTable, in ascending order, so plugins work on numpy
columns, all candidates at once.

Plugins are registered by type name (registry.py) and built with `(parameters, handle)`: `parameters` are
the configuration's for that instance, `handle` the state the picker shares with its plugins.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..datastore.load_table import LoadTable
from .precise_prefix import PrecisePrefixScorer
from .prefix import PrefixIndex
from .request import Decision, RoutingError, RoutingRequest


@dataclass
class Context:
    """One scheduling cycle: the request, the pool's table, and what plugins leave for later ones (the
    Inference Extension's CycleState)."""
    request: RoutingRequest
    table: LoadTable
    free_slot: bool = False  # the fair queue's dispatch: prefer endpoints with room in their running batch
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class PluginHandle:
    """What the picker shares with the plugins it builds: state kept across requests, and the flags' values,
    which a plugin's parameters default to."""
    prefix_index: PrefixIndex = field(default_factory=PrefixIndex)
    precise: PrecisePrefixScorer | None = None  # --prefix-routing precise
    noise: np.random.Generator = field(default_factory=np.random.default_rng)  # tie-breaks, seeded by the picker
    queue_threshold: float = 5.0
    kv_threshold: float = 0.8
    stale_after: float = 5.0
    max_failures: int = 3
    fallbacks: int = 2


class Plugin:
    """Built from its configuration's parameters and the picker's handle; stateless plugins need neither."""

    def __init__(self, parameters: dict[str, Any] | None = None, handle: PluginHandle | None = None) -> None:
        self.parameters = parameters or {}
        self.handle = handle or PluginHandle()


class Filter(Plugin):
    def filter(self, ctx: Context, rows: np.ndarray) -> np.ndarray:
        """The rows that stay candidates (a subset of `rows`, in their order). May raise RoutingError, whose
        status answers the client (404 unknown model, 503 none ready, 429 shed)."""
        raise NotImplementedError


class Scorer(Plugin):
    def score(self, ctx: Context, rows: np.ndarray) -> np.ndarray:
        """One score in [0, 1] per candidate row, higher is better."""
        raise NotImplementedError


class Picker(Plugin):
    uses_scores = True  # False: the scorers are not run and the decision carries no scores

    def pick(self, ctx: Context, rows: np.ndarray, totals: np.ndarray, count: int) -> np.ndarray:
        """Positions in `rows` of at most `count` endpoints, the choice first, then its fallbacks."""
        raise NotImplementedError


@dataclass
class WeightedScorer:
    name: str  # the key of the decision's scores
    scorer: Scorer
    weight: float


@dataclass
class Profile:
    """Filters + weighted scorers + a picker: one way of choosing an endpoint."""
    name: str
    filters: list[Filter]
    scorers: list[WeightedScorer]
    picker: Picker
    fallbacks: int = 2

    def __post_init__(self) -> None:
        # Fixed once built: a pick walks these lists only (weight-0 scorers are not run).
        self._weighted = [s for s in self.scorers if s.weight]
        self._pre_request = [p.pre_request for p in self.plugins() if hasattr(p, "pre_request")]

    def plugins(self) -> list[Plugin]:
        return [*self.filters, *(s.scorer for s in self.scorers), self.picker]

    def run(self, ctx: Context, clock: Callable[[], float]) -> Decision:
        table = ctx.table
        rows = np.arange(len(table.endpoints))
        for f in self.filters:
            rows = f.filter(ctx, rows)
        if not rows.size:
            raise RoutingError(503, f"no endpoint passed the filters of scheduling profile `{self.name}`")
        scores: dict[str, np.ndarray] = {}
        totals = np.zeros(len(rows))
        if self.picker.uses_scores:
            for s in self._weighted:
                values = scores[s.name] = s.scorer.score(ctx, rows)
                totals += s.weight * values
        order = self.picker.pick(ctx, rows, totals, 1 + self.fallbacks)
        best = table.endpoints[rows[order[0]]]
        sent = best.record_dispatch(clock())
        for hook in self._pre_request:
            hook(ctx, best)
        chosen = {name: float(values[order[0]]) for name, values in scores.items()}
        if self.picker.uses_scores:
            chosen["total"] = float(totals[order[0]])
        return Decision(best, [table.endpoints[rows[i]] for i in order[1:]], chosen, sent)


class ProfileHandler(Plugin):
    """Chooses the profile(s) a request runs (P/D disaggregation runs a prefill and a decode profile) and
    makes one decision of their results."""

    def pick_profiles(self, ctx: Context, profiles: dict[str, Profile]) -> list[str]:
        raise NotImplementedError

    def process_results(self, ctx: Context, results: dict[str, Decision]) -> Decision:
        raise NotImplementedError
