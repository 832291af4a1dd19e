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
  prefix    share of the prompt's leading chunks already sent to that endpoint (its likely cached prefix);
            with --prefix-routing precise, share of its leading KV blocks the pod holds by its KV events
            (precise_prefix.py), for the pods whose events the gateway follows
  affinity  rendezvous hash of the prompt's opening and the endpoint: the same preference in every replica
The best endpoint wins; the next ones are fallbacks, for a proxy or Envoy to retry on. The scorers work
on the pool's columns (load_table.py), all candidates at once: a pick at 500 endpoints takes ~0.1 ms.

`policy="round-robin"` replaces the scoring with a per-model rotation over the ready endpoints that serve
the model (what a plain Kubernetes Service would do): the baseline the routing benchmark measures against.
Admission (404/503, shedding) is the same under both policies, so only the choice of pod differs.
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from ..datastore.endpoints import Endpoint, EndpointPool
from ..datastore.load_table import LoadTable
from .precise_prefix import PrecisePrefixScorer
from .prefix import PrefixIndex, affinity_key, chunk_hashes

logger = logging.getLogger(__name__)

# prefix outweighs queue + active together, so a long shared prompt goes home even when home has one
# more request in flight than its peers (measured in benchmarks/routing_sim.py: no cost in TTFT there).
# affinity only nudges: it matters for a prompt no pod has seen, and there it makes independent gateway
# replicas agree (routing_sim.py, 4 replicas at 100 pods: TTFT p95 359 -> 246 ms; one replica unchanged).
DEFAULT_WEIGHTS = {"queue": 2.0, "active": 1.0, "kv_cache": 1.0, "lora": 2.0, "prefix": 4.0, "affinity": 1.0}
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
    hashes: list[int] | None = None  # the prompt's prefix-chunk hashes, computed once per request
    affinity: int | None = None  # prefix.affinity_key of the prompt, computed once per request
    max_tokens: int | None = None  # the completion budget the client asked for (tenant token estimate)
    requested_model: str = ""  # the model the client named, when a fallback serves it instead
    ticket: object | None = None  # the tenant admission (tenant_gate.Ticket), settled when the request ends
    deadline: float | None = None  # monotonic end of the client's time budget (x-request-timeout-ms)
    estimated_tokens: int | None = None  # token_estimate.py: what admission charges the tenant
    add_usage: bool = False  # a stream whose usage the gateway asks for, and strips (engine_body.py)
    body: dict | None = None  # the parsed body, for the precise scorer's tokenizer
    token_ids: list[int] | None = None  # the prompt's token ids ([]: not knowable here), computed once

    def affinity_key(self) -> int:
        if self.affinity is None:
            self.affinity = affinity_key(self.model, self.prompt)
        return self.affinity

    def prefix_hashes(self) -> list[int]:
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
    """What the scorers see: the request and its candidates' rows in the pool's table."""
    request: RoutingRequest
    table: LoadTable
    rows: np.ndarray
    hashes: list[int]
    prefix_index: PrefixIndex
    precise: PrecisePrefixScorer | None = None
    block_keys: list[int] | None = None  # the request's KV block keys, when scored precisely


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


# -- scorers: context -> one score in [0, 1] per candidate ------------------------------------------
def _fewer_is_better(values: np.ndarray) -> np.ndarray:
    """Min-max normalised over the candidates: the least loaded scores 1, the most loaded 0."""
    low, high = values.min(), values.max()
    return np.ones(len(values)) if high == low else (high - values) / (high - low)


def score_queue(ctx: Context) -> np.ndarray:
    return _fewer_is_better(ctx.table.queue[ctx.rows])


def score_active(ctx: Context) -> np.ndarray:
    return _fewer_is_better(ctx.table.active[ctx.rows])


def score_kv_cache(ctx: Context) -> np.ndarray:
    return np.maximum(0.0, 1.0 - ctx.table.kv_usage[ctx.rows])


def score_lora(ctx: Context) -> np.ndarray:
    model, table, rows = ctx.request.model, ctx.table, ctx.rows
    if not model:
        return np.ones(len(rows))
    active = (table.base.mask(model) | table.running_adapters.mask(model))[rows]
    free_slot = (table.loaded.mask(model) & table.free_adapter_slot)[rows]
    waiting = table.waiting_adapters.mask(model)[rows]
    return np.where(active, 1.0, np.where(free_slot, 0.8, np.where(waiting, 0.6, 0.0)))


def score_prefix(ctx: Context) -> np.ndarray:
    matched = np.zeros(len(ctx.table.endpoints))
    for address, count in ctx.prefix_index.match_counts(ctx.hashes).items():
        row = ctx.table.rows.get(address)
        if row is not None:
            matched[row] = count
    share = matched[ctx.rows] / max(1, len(ctx.hashes))
    if ctx.block_keys is None:
        return share
    # Precise where the pod's events are followed; the approximate share for the others.
    addresses = [ctx.table.endpoints[row].address for row in ctx.rows]
    held = ctx.precise.matched(ctx.block_keys, addresses)
    blocks = max(1, len(ctx.block_keys))
    return np.array([held.get(a, 0.0) / blocks if ctx.precise.tracks(a) or a in held else share[i]
                     for i, a in enumerate(addresses)])


AFFINITY_MIN_CHUNKS = 4  # 256 characters, about 64 tokens


def score_affinity(ctx: Context) -> np.ndarray:
    """Rendezvous hashing of the prompt's opening over the candidates: a fixed, pseudo-random preference
    per prompt family that every gateway replica computes alike, so replicas that share no state still
    send a new prefix to the same pod (and, when it is busy, to the same second choice). A prompt too
    short to leave reusable KV blocks gets no preference: it goes wherever load says."""
    if len(ctx.hashes) < AFFINITY_MIN_CHUNKS:
        return np.zeros(len(ctx.rows))
    mixed = _mix64(ctx.table.address_keys[ctx.rows] ^ np.uint64(ctx.request.affinity_key()))
    return mixed.astype(np.float64) / 2.0 ** 64


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit moves every output bit (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


SCORERS: dict[str, Callable[[Context], np.ndarray]] = {
    "queue": score_queue, "active": score_active, "kv_cache": score_kv_cache, "lora": score_lora, "prefix": score_prefix,
    "affinity": score_affinity}
TIE_BREAK = 1e-9  # random noise this small only orders equal totals: a burst spreads over equal pods


class Picker:
    def __init__(self, pool: EndpointPool, config: PickerConfig | None = None,
                 prefix_index: PrefixIndex | None = None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic, precise: PrecisePrefixScorer | None = None) -> None:
        """`clock` stamps dispatches; scrapes (`Endpoint.record_scrape(started=...)`) must use the same one.
        A simulation passes its own. `precise`: --prefix-routing precise (the engines' KV events)."""
        self.precise = precise
        self._approximate_logged = False
        self.pool = pool
        self.clock = clock
        self.config = config or PickerConfig()
        self.prefix_index = prefix_index or PrefixIndex()
        self.rng = rng or random.Random()
        self._noise = np.random.default_rng(self.rng.getrandbits(64))  # tie-breaks, seeded by `rng`
        self.table = LoadTable(pool)
        self._turns: dict[str, int] = {}  # round-robin position, per model

    def _ready(self) -> np.ndarray:
        self.table.sync()
        return self.table.ready(time.monotonic(), self.config.stale_after, self.config.max_failures)

    def ready_endpoints(self) -> list[Endpoint]:
        return [self.table.endpoints[row] for row in np.flatnonzero(self._ready())]

    def _saturated_rows(self, rows: np.ndarray) -> np.ndarray:
        return ((self.table.queue[rows] >= self.config.queue_threshold)
                | (self.table.kv_usage[rows] >= self.config.kv_threshold))

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
        """`free_slot`: prefer endpoints with a free place in their running batch (the fair queue's
        dispatch: the engine then starts the request at once instead of queueing it)."""
        ready, table = self._ready(), self.table
        if request.subset is not None and not (ready & table.addresses(request.subset)).any():
            raise RoutingError(503, f"none of the {len(request.subset)} endpoints of the subset hint is ready")
        if not ready.any():
            raise RoutingError(503, "no engine endpoint is ready")
        rows = self.serving_rows(request, ready)
        if not rows.size:
            if request.exclude and self.serving_rows(replace(request, exclude=frozenset()), ready).size:
                raise RoutingError(503, f"no other ready endpoint serves model `{request.model}` right now")
            if table.knows(request.model):
                raise RoutingError(503, f"no ready endpoint serves model `{request.model}` right now")
            raise RoutingError(404, f"The model `{request.model}` does not exist.")
        candidates = rows[~self._saturated_rows(rows)]
        if not candidates.size:
            if request.sheddable:
                raise RoutingError(429, f"every endpoint serving `{request.model}` is saturated; "
                                        "sheddable requests are refused until load drops")
            candidates = rows
        if free_slot and (roomy := candidates[~table.batch_full[candidates]]).size:
            candidates = roomy
        if self.config.policy == "round-robin":
            return self._rotate(request.model, [table.endpoints[row] for row in rows])
        ctx = Context(request, table, candidates, request.prefix_hashes(), self.prefix_index, self.precise,
                      self._block_keys(request) if self.config.weights.get("prefix") else None)
        scores = {name: SCORERS[name](ctx) for name, w in self.config.weights.items() if w}
        total = np.zeros(len(candidates))
        for name, values in scores.items():
            total += self.config.weights[name] * values
        order = _best_first(total + TIE_BREAK * self._noise.random(len(candidates)), 1 + self.config.fallbacks)
        best = table.endpoints[candidates[order[0]]]
        sent = best.record_dispatch(self.clock())
        self.prefix_index.remember(best.address, ctx.hashes)
        if ctx.block_keys:
            self.precise.remember(best.address, ctx.block_keys)
        return Decision(best, [table.endpoints[candidates[i]] for i in order[1:]],
                        {**{name: float(values[order[0]]) for name, values in scores.items()},
                         "total": float(total[order[0]])}, sent)

    def _block_keys(self, request: RoutingRequest) -> list[int] | None:
        """The request's KV block keys for the precise scorer; None (approximate) when precise routing is off,
        or no engine's events are followed yet, or the prompt cannot be tokenized here."""
        if self.precise is None or (request.body is None and request.token_ids is None):
            return None
        lora = None if not request.model or self.table.base.mask(request.model).any() else request.model
        keys = self.precise.keys(request, lora)
        if keys is None and not self._approximate_logged:
            self._approximate_logged = True
            logger.warning("--prefix-routing precise: %s; scoring prefixes approximately until then",
                           "no engine publishes KV events yet" if not self.precise.index.block_sizes else
                           f"no tokenizer for `{request.model}` (--tokenizer)")
        return keys

    def _rotate(self, model: str, serving: list[Endpoint]) -> Decision:
        """Round-robin: blind to load, cache and adapters, but never to which endpoints serve the model."""
        turn = self._turns.get(model, 0)
        self._turns[model] = turn + 1
        start = turn % len(serving)
        order = serving[start:] + serving[:start]
        sent = order[0].record_dispatch(self.clock())  # keeps the gateway's own load accounting policy-independent
        return Decision(order[0], order[1:1 + self.config.fallbacks], {}, sent)


def _best_first(keys: np.ndarray, count: int) -> np.ndarray:
    """Positions of the `count` highest keys, highest first, without sorting them all."""
    if len(keys) > count:
        top = np.argpartition(-keys, count - 1)[:count]
        return top[np.argsort(-keys[top])]
    return np.argsort(-keys)
