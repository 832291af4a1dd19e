"""What the gateway knows about each engine pod: its address, the models it serves and its live load.

Load comes from the engine's own Prometheus metrics (vLLM's names, so any vLLM-compatible engine can
sit behind this gateway) and its `/v1/models`; placement comes from the pod annotation the operator
writes. Between scrapes the gateway adds what it dispatched itself, so a burst does not all land on
the pod that looked idlest at the last scrape:

  * a request dispatched after the last scrape *started* is "unseen": that scrape could not count it.
    It stays unseen until a scrape that started after it, however many scrapes end meanwhile;
  * in proxy mode the gateway also sees each request end. One that ends while still unseen is simply
    dropped; one the last scrape counted as running is subtracted from that count until the next scrape.
    So between scrapes the load is exact when this gateway is the pod's only client.
Behind Envoy (ext_proc) the gateway does not see requests end, and only the first rule applies.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

ADAPTERS_ANNOTATION = "serving.kubeinfer.io/adapters"


@dataclass
class EngineState:
    """One scrape of an engine's /metrics."""
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_loras: int = 0
    max_running: int = 0  # the engine's batch size limit (max_num_seqs); 0: not reported
    load_report: bool = False  # read from our engine's /load (else Prometheus text: vLLM or another engine)
    kv_events: dict | None = None  # /load's `kv_events`: where the engine publishes KV events (None: off)


def parse_engine_metrics(text: str) -> EngineState:
    """Read the gauges the picker needs; series of several models on one pod are summed. The reference
    for metrics_text.read_engine_metrics, which the scraper uses (it reads only these four names)."""
    state, latest_lora = EngineState(), float("-inf")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_waiting":
                state.waiting += sample.value
            elif sample.name == "vllm:num_requests_running":
                state.running += sample.value
            elif sample.name == "vllm:kv_cache_usage_perc":
                state.kv_usage = max(state.kv_usage, sample.value)
            elif sample.name == "vllm:lora_requests_info" and sample.value >= latest_lora:
                latest_lora = sample.value  # its value is when it was set: the latest wins
                read_lora_info(state, sample.labels)
    return state


def read_lora_info(state: EngineState, labels: dict[str, str]) -> None:
    """The adapters and slots of a `vllm:lora_requests_info` sample's labels (comma-joined names)."""
    state.running_adapters = _names(labels.get("running_lora_adapters", ""))
    state.waiting_adapters = _names(labels.get("waiting_lora_adapters", ""))
    state.max_loras = int(float(labels.get("max_lora", "0") or 0))


def _names(value: str) -> frozenset[str]:
    return frozenset(name for name in value.split(",") if name)


@dataclass
class Endpoint:
    address: str  # "ip:port", what Envoy's original-destination cluster dials
    placed_adapters: frozenset[str] = frozenset()  # from the pod annotation: assigned, maybe not loaded (yet)
    name: str = ""  # pod name, for logs and metrics
    state: EngineState | None = None
    models: frozenset[str] = frozenset()  # ids from /v1/models: base model and loaded adapters
    base_models: frozenset[str] = frozenset()
    cards: dict[str, dict] = field(default_factory=dict)  # id -> the engine's /v1/models card
    models_stale: bool = False  # an answer contradicted `models`: read /v1/models again at the next scrape
    refused_models: frozenset[str] = frozenset()  # answered 404 for these: not sent again until it lists them
    last_scrape: float | None = None  # monotonic time of the last successful scrape
    consecutive_failures: int = 0
    unseen: Counter[float] = field(default_factory=Counter)  # dispatch times of requests no scrape could count
    finished_since_scrape: int = 0  # requests the last scrape counted that have ended since

    _changes = None  # the pool's set of changed addresses (load_table.py rewrites only those rows)

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        self._changed()

    def _changed(self) -> None:
        if self._changes is not None:
            self._changes.add(self.address)

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def drop_model(self, model: str) -> None:
        """The pod answered 404 for `model`: stop sending it there until its /v1/models lists it."""
        self.models = self.models - {model}
        self.refused_models = self.refused_models | {model}
        self.models_stale = True

    @property
    def num_unseen(self) -> int:
        return sum(self.unseen.values())

    @property
    def queue(self) -> float:
        """Waiting requests, plus those we sent that the last scrape could not see yet."""
        waiting = self.state.waiting if self.state else 0.0
        return waiting + self.num_unseen

    @property
    def active(self) -> float:
        """Requests in its running batch, less those that ended since the scrape, plus the unseen ones:
        the load an engine that admits everything at once (no waiting queue) still has."""
        running = self.state.running if self.state else 0.0
        return max(0.0, running - self.finished_since_scrape) + self.num_unseen

    def record_dispatch(self, now: float | None = None) -> float:
        """A request was sent here; returns its dispatch time, the ticket `record_finish` takes."""
        sent = time.monotonic() if now is None else now
        self.unseen[sent] += 1
        self._changed()
        return sent

    def record_finish(self, sent: float) -> None:
        """The request dispatched at `sent` has ended (its response is complete, failed or abandoned)."""
        if self.unseen[sent] > 0:  # no scrape saw it: it never was load anyone counted
            self.unseen[sent] -= 1
            if not self.unseen[sent]:
                del self.unseen[sent]
        else:
            self.finished_since_scrape += 1
        self._changed()

    def record_scrape(self, state: EngineState, models: frozenset[str], base_models: frozenset[str],
                      started: float | None = None, cards: dict[str, dict] | None = None) -> None:
        """A scrape that began at `started` (default: now) succeeded; it counts every request sent before."""
        self.state, self.models, self.base_models = state, models, base_models
        if cards is not None:  # a fresh read of /v1/models
            self.cards, self.models_stale = cards, False
        self.refused_models = self.refused_models - models
        self.last_scrape = time.monotonic()
        started = self.last_scrape if started is None else started
        self.consecutive_failures = 0
        self.finished_since_scrape = 0
        for sent in [sent for sent in self.unseen if sent < started]:
            del self.unseen[sent]
        self._changed()

    def record_failure(self) -> None:
        self.consecutive_failures += 1


@dataclass
class EndpointPool:
    """The current endpoints by address; discovery replaces membership, the scraper fills in state.
    `version` counts membership changes and `changes` collects the addresses whose state changed since
    the picker's table last read them."""
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    version: int = 0
    changes: set[str] = field(default_factory=set)

    def set_members(self, members: list[Endpoint]) -> None:
        """Adopt a new membership, keeping the state of endpoints that stay."""
        fresh = {}
        for member in members:
            known = self.endpoints.get(member.address)
            if known is not None:
                known.placed_adapters, known.name = member.placed_adapters, member.name or known.name
                fresh[member.address] = known
            else:
                fresh[member.address] = member
        for endpoint in fresh.values():
            object.__setattr__(endpoint, "_changes", self.changes)
        self.endpoints = fresh
        self.version += 1

    def __iter__(self):
        return iter(list(self.endpoints.values()))

    def __len__(self) -> int:
        return len(self.endpoints)
