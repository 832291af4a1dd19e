"""The endpoint picker: filters, weighted scorers and a pick, as in the Gateway API Inference Extension.

For each request: keep endpoints that are ready (scraped recently, not failing) and serve the requested
model (base or adapter) by their own /v1/models; when none has an adapter loaded, the pods it is
assigned to (they load it); prefer those not saturated (queue or KV cache over a threshold); a sheddable
request meeting a fully saturated pool is refused (429) instead of queueing behind critical traffic.
The survivors are scored by plugins, each in [0, 1], combined by configurable weights:
  queue     fewer waiting requests (min-max normalised over the candidates, counting our own dispatches)
  active    fewer running requests (same normalisation): an engine that admits everything has no queue
  kv_cache  more free KV cache
  lora      1.0 adapter active, 0.8 a free adapter slot, 0.6 adapter waiting, 0 otherwise
  prefix    share of the prompt's leading chunks already sent to that endpoint (its likely cached prefix)
The best endpoint wins; the next ones are fallbacks, for a proxy or Envoy to retry on.

`policy="round-robin"` replaces the scoring with a per-model rotation over the ready endpoints that serve
the model (what a plain Kubernetes Service would do): the baseline the routing benchmark measures against.
Admission (404/503, shedding) is the same under both policies, so only the choice of pod differs.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property

from .endpoints import Endpoint, EndpointPool
from .prefix import PrefixIndex, chunk_hashes

# prefix outweighs queue + active together, so a long shared prompt goes home even when home has one
# more request in flight than its peers (measured in benchmarks/routing_sim.py: no cost in TTFT there).
DEFAULT_WEIGHTS = {"queue": 2.0, "active": 1.0, "kv_cache": 1.0, "lora": 2.0, "prefix": 4.0}
POLICIES = ("scored", "round-robin")


class RoutingError(Exception):
    """No endpoint can take the request; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


@dataclass
class RoutingRequest:
    model: str  # empty: any endpoint will do (e.g. GET /v1/models)
    prompt: str = ""  # text the prefix scorer hashes (the prompt, or the chat messages)
    sheddable: bool = False
    subset: frozenset[str] | None = None  # the data plane's subset hint: only these addresses may be picked
    priority: int = 0  # the Inference Extension's: higher is more important, below 0 sheddable
    exclude: frozenset[str] = frozenset()  # addresses already tried for this request (a retry picks again)
    hashes: list[bytes] | None = None  # the prompt's prefix-chunk hashes, computed once per request
    max_tokens: int | None = None  # the completion budget the client asked for (tenant token estimate)
    requested_model: str = ""  # the model the client named, when a fallback serves it instead
    ticket: object | None = None  # the tenant admission (tenant_gate.Ticket), settled when the request ends
    deadline: float | None = None  # monotonic end of the client's time budget (x-request-timeout-ms)

    def prefix_hashes(self) -> list[bytes]:
        if self.hashes is None:
            self.hashes = chunk_hashes(self.model, self.prompt)
        return self.hashes


@dataclass
class PickerConfig:
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    queue_threshold: float = 5.0  # waiting requests at which an endpoint is saturated
    kv_threshold: float = 0.8  # KV-cache usage at which an endpoint is saturated
    stale_after: float = 5.0  # seconds after which a scrape is no longer trusted
    max_failures: int = 3  # consecutive failed scrapes that take an endpoint out
    fallbacks: int = 2
    policy: str = "scored"  # or "round-robin": the load-blind baseline

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        unknown = set(self.weights) - set(SCORERS)
        if unknown:
            raise ValueError(f"unknown scorer(s) {', '.join(sorted(unknown))}; known: {', '.join(SCORERS)}")
        if any(w < 0 for w in self.weights.values()):
            raise ValueError("scorer weights must be >= 0")


@dataclass
class Context:
    request: RoutingRequest
    candidates: list[Endpoint]
    hashes: list[bytes]
    prefix_index: PrefixIndex

    @cached_property
    def queue_range(self) -> tuple[float, float]:
        """Computed once per pick, not once per endpoint: that would make a pick quadratic in pool size."""
        queues = [e.queue for e in self.candidates]
        return min(queues), max(queues)

    @cached_property
    def active_range(self) -> tuple[float, float]:
        active = [e.active for e in self.candidates]
        return min(active), max(active)


@dataclass
class Decision:
    endpoint: Endpoint
    fallbacks: list[Endpoint]
    scores: dict[str, float]
    sent: float = 0.0  # the dispatch ticket: hand it to endpoint.record_finish when the request ends

    @property
    def destination(self) -> str:
        """Envoy's x-gateway-destination-endpoint value: the pick, then fallbacks, comma-separated."""
        return ",".join(e.address for e in [self.endpoint, *self.fallbacks])


# -- scorers: (endpoint, context) -> [0, 1] ----------------------------------------------------------
def score_queue(endpoint: Endpoint, ctx: Context) -> float:
    low, high = ctx.queue_range
    return 1.0 if high == low else (high - endpoint.queue) / (high - low)


def score_active(endpoint: Endpoint, ctx: Context) -> float:
    low, high = ctx.active_range
    return 1.0 if high == low else (high - endpoint.active) / (high - low)


def score_kv_cache(endpoint: Endpoint, ctx: Context) -> float:
    return max(0.0, 1.0 - endpoint.state.kv_usage)


def score_lora(endpoint: Endpoint, ctx: Context) -> float:
    model, state = ctx.request.model, endpoint.state
    if not model or model in endpoint.base_models or model in state.running_adapters:
        return 1.0
    if model in endpoint.models and len(state.running_adapters) < state.max_loras:
        return 0.8
    if model in state.waiting_adapters:
        return 0.6
    return 0.0


def score_prefix(endpoint: Endpoint, ctx: Context) -> float:
    return ctx.prefix_index.match_fraction(endpoint.address, ctx.hashes)


SCORERS: dict[str, Callable[[Endpoint, Context], float]] = {
    "queue": score_queue, "active": score_active, "kv_cache": score_kv_cache, "lora": score_lora, "prefix": score_prefix}


class Picker:
    def __init__(self, pool: EndpointPool, config: PickerConfig | None = None,
                 prefix_index: PrefixIndex | None = None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock` stamps dispatches; scrapes (`Endpoint.record_scrape(started=...)`) must use the same one.
        A simulation passes its own."""
        self.pool = pool
        self.clock = clock
        self.config = config or PickerConfig()
        self.prefix_index = prefix_index or PrefixIndex()
        self.rng = rng or random.Random()
        self._turns: dict[str, int] = {}  # round-robin position, per model

    def ready_endpoints(self) -> list[Endpoint]:
        now = time.monotonic()
        return [e for e in self.pool if e.is_ready(self.config.stale_after, self.config.max_failures, now)]

    def saturated(self, endpoint: Endpoint) -> bool:
        return endpoint.queue >= self.config.queue_threshold or endpoint.state.kv_usage >= self.config.kv_threshold

    def pick(self, request: RoutingRequest) -> Decision:
        ready = self.ready_endpoints()
        if request.subset is not None:
            ready = [e for e in ready if e.address in request.subset]
            if not ready:
                raise RoutingError(503, f"none of the {len(request.subset)} endpoints of the subset hint is ready")
        if not ready:
            raise RoutingError(503, "no engine endpoint is ready")
        serving = self.serving(request, ready)
        if not serving:
            if request.exclude and self.serving(replace(request, exclude=frozenset()), ready):
                raise RoutingError(503, f"no other ready endpoint serves model `{request.model}` right now")
            if any(e.serves(request.model) or e.is_assigned(request.model) for e in self.pool):
                raise RoutingError(503, f"no ready endpoint serves model `{request.model}` right now")
            raise RoutingError(404, f"The model `{request.model}` does not exist.")
        candidates = [e for e in serving if not self.saturated(e)]
        if not candidates:
            if request.sheddable:
                raise RoutingError(429, f"every endpoint serving `{request.model}` is saturated; "
                                        "sheddable requests are refused until load drops")
            candidates = serving
        if self.config.policy == "round-robin":
            return self._rotate(request.model, serving)
        ctx = Context(request, candidates, request.prefix_hashes(), self.prefix_index)
        ranked = []
        for endpoint in candidates:
            scores = {name: SCORERS[name](endpoint, ctx) for name, w in self.config.weights.items() if w}
            total = sum(self.config.weights[name] * s for name, s in scores.items())
            ranked.append((total, self.rng.random(), endpoint, scores))  # random breaks ties: bursts spread
        ranked.sort(key=lambda r: (r[0], r[1]), reverse=True)
        best = ranked[0][2]
        sent = best.record_dispatch(self.clock())
        self.prefix_index.remember(best.address, ctx.hashes)
        return Decision(best, [r[2] for r in ranked[1:1 + self.config.fallbacks]], {**ranked[0][3], "total": ranked[0][0]},
                        sent)

    @staticmethod
    def serving(request: RoutingRequest, ready: list[Endpoint]) -> list[Endpoint]:
        """Ready endpoints not yet tried that have the model loaded, else those it is assigned to."""
        untried = [e for e in ready if e.address not in request.exclude] if request.exclude else ready
        if not request.model:
            return untried
        loaded = [e for e in untried if e.serves(request.model)]
        return loaded or [e for e in untried if e.is_assigned(request.model)]

    def _rotate(self, model: str, serving: list[Endpoint]) -> Decision:
        """Round-robin: blind to load, cache and adapters, but never to which endpoints serve the model."""
        turn = self._turns.get(model, 0)
        self._turns[model] = turn + 1
        start = turn % len(serving)
        order = serving[start:] + serving[:start]
        sent = order[0].record_dispatch(self.clock())  # keeps the gateway's own load accounting policy-independent
        return Decision(order[0], order[1:1 + self.config.fallbacks], {}, sent)
