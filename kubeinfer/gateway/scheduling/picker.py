"""The endpoint picker, as in the Gateway API Inference Extension: for each request a scheduling cycle of
filters, weighted scorers and a picker (framework.py), composed into profiles by configuration (profiles.py)
from plugins registered by name (registry.py, plugins/).

The default profile, from the flags: keep endpoints that are ready (scraped recently, not failing) and serve
the requested model (base or adapter) by their own /v1/models; when none has an adapter loaded, the pods it is
assigned to (they load it); prefer those not saturated (queue or KV cache over a threshold); a sheddable
request meeting a fully saturated pool is refused (429) instead of queueing behind critical traffic.
The survivors are scored by plugins, each in [0, 1], combined by configurable weights:
  queue     fewer waiting requests (min-max normalised over the candidates, counting our own dispatches)
  active    fewer running requests (same normalisation): an engine that admits everything has no queue
  kv_cache  more free KV cache
  lora      1.0 adapter active, 0.8 a free adapter slot, 0.6 adapter waiting, 0 otherwise
  prefix    share of the prompt's leading chunks already sent to that endpoint (its likely cached prefix);
            with --prefix-routing precise, share of its leading KV blocks the pod holds by its KV events
            (precise_prefix.py), for the pods whose events the gateway follows
  affinity  rendezvous hash of the prompt's opening and the endpoint: the same preference in every replica
The best endpoint wins; the next ones are fallbacks, for a proxy or Envoy to retry on. The plugins work
on the pool's columns (load_table.py), all candidates at once: a pick at 500 endpoints takes ~0.1 ms.

`policy="round-robin"` replaces the scoring with a per-model rotation over the ready endpoints that serve
the model (what a plain Kubernetes Service would do): the baseline the routing benchmark measures against.
Admission (404/503, shedding) is the same under both policies, so only the choice of pod differs.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable

import numpy as np

from ..datastore.endpoints import Endpoint, EndpointPool
from ..datastore.load_table import LoadTable
from .config import DEFAULT_WEIGHTS, POLICIES, PickerConfig
from .framework import Context, PluginHandle
from .plugins.load_filters import saturated
from .precise_prefix import PrecisePrefixScorer
from .prefix import PrefixIndex
from .profiles import configured_profiles, default_profiles
from .request import Decision, RoutingError, RoutingRequest

__all__ = ["DEFAULT_WEIGHTS", "POLICIES", "Decision", "Picker", "PickerConfig", "RoutingError", "RoutingRequest"]


class Picker:
    def __init__(self, pool: EndpointPool, config: PickerConfig | None = None,
                 prefix_index: PrefixIndex | None = None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic, precise: PrecisePrefixScorer | None = None) -> None:
        """`clock` stamps dispatches; scrapes (`Endpoint.record_scrape(started=...)`) must use the same one.
        A simulation passes its own. `precise`: --prefix-routing precise (the engines' KV events)."""
        self.precise = precise
        self.pool = pool
        self.clock = clock
        self.config = config or PickerConfig()
        self.prefix_index = prefix_index or PrefixIndex()
        self.rng = rng or random.Random()
        c = self.config
        # The state the plugins share: the prefix index (the app prunes departed pods from it), tie-break noise.
        self.handle = PluginHandle(self.prefix_index, precise, np.random.default_rng(self.rng.getrandbits(64)),
                                   c.queue_threshold, c.kv_threshold, c.stale_after, c.max_failures, c.fallbacks)
        self.profile_handler, self.profiles = (
            configured_profiles(c.scheduler, self.handle) if c.scheduler is not None
            else default_profiles(c.weights, c.policy, self.handle))
        self.table = LoadTable(pool)

    def _ready(self) -> np.ndarray:
        self.table.sync()
        return self.table.ready(time.monotonic(), self.config.stale_after, self.config.max_failures)

    def ready_endpoints(self) -> list[Endpoint]:
        return [self.table.endpoints[row] for row in np.flatnonzero(self._ready())]

    def _saturated_rows(self, rows: np.ndarray) -> np.ndarray:
        return saturated(self.table, rows, self.config.queue_threshold, self.config.kv_threshold)

    def knows(self, model: str) -> bool:
        """Some endpoint, ready or not, serves or is assigned the model."""
        self.table.sync()
        return self.table.knows(model)

    def has_ready(self, model: str, unsaturated: bool = False) -> bool:
        """A ready endpoint serves the model or is assigned it (and, with `unsaturated`, is not saturated)."""
        ready = self._ready()
        rows = np.flatnonzero(ready & (self.table.loaded.mask(model) | self.table.assigned.mask(model)))
        return bool(rows.size) and (not unsaturated or not self._saturated_rows(rows).all())

    def serving_rows(self, request: RoutingRequest, ready: np.ndarray | None = None) -> np.ndarray:
        """Rows of the ready endpoints (of the subset hint) not yet tried that have the model loaded,
        else those it is assigned to."""
        ready = self._ready() if ready is None else ready
        if request.subset is not None:
            ready = ready & self.table.addresses(request.subset)
        untried = ready & ~self.table.addresses(request.exclude) if request.exclude else ready
        return np.flatnonzero(self.table.serving(request.model, untried))

    def has_free_endpoint(self, request: RoutingRequest, free_slot: bool = False) -> bool | None:
        """None when no ready endpoint serves the request, else whether one of them is not saturated (and,
        with `free_slot`, has room in its running batch where the engine reports its size)."""
        rows = self.serving_rows(request)
        if not rows.size:
            return None
        busy = self._saturated_rows(rows)
        if free_slot:
            busy |= self.table.batch_full[rows]
        return not busy.all()

    def pick(self, request: RoutingRequest, free_slot: bool = False) -> Decision:
        """One scheduling cycle: the profile handler's profiles run, and it makes one decision of them.
        `free_slot`: prefer endpoints with a free place in their running batch (the fair queue's dispatch:
        the engine then starts the request at once instead of queueing it)."""
        self.table.sync()
        ctx = Context(request, self.table, free_slot)
        names = self.profile_handler.pick_profiles(ctx, self.profiles)
        results = {name: self.profiles[name].run(ctx, self.clock) for name in names}
        return self.profile_handler.process_results(ctx, results)
