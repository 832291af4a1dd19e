"""One routing decision, shared by the ext_proc server and the proxy: parse, pick, count."""
from __future__ import annotations

import time
from collections import ChainMap
from collections.abc import Mapping

from .metrics import UNKNOWN_MODEL, GatewayMetrics
from .picker import Decision, Picker, RoutingError, RoutingRequest
from .request_info import parse_request, with_engine_priority


class Router:
    def __init__(self, picker: Picker, metrics: GatewayMetrics | None = None,
                 model_priorities: Mapping[str, int] | None = None, forward_priority: bool = False) -> None:
        self.picker = picker
        self.forward_priority = forward_priority
        self.metrics = metrics or GatewayMetrics(picker)
        self.model_priorities = dict(model_priorities or {})  # configured: wins
        self.discovered_priorities: dict[str, int] = {}  # from InferenceModels in the cluster
        self.objective_priorities: dict[str, int] = {}  # from the Inference Extension's InferenceObjectives

    def route(self, raw_body: bytes, headers: Mapping[str, str], subset: frozenset[str] | None = None
              ) -> tuple[RoutingRequest, Decision]:
        """Raises RoutingError with the HTTP status to answer (400, 404, 429, 503). `subset`: the only
        endpoints (ip:port) the data plane allows for this request."""
        request = None
        try:
            request = parse_request(raw_body, headers, ChainMap(self.model_priorities, self.discovered_priorities),
                                    self.objective_priorities)
            request.subset = subset
            start = time.perf_counter()
            decision = self.picker.pick(request)
            self.metrics.pick_duration.observe(time.perf_counter() - start)
        except RoutingError as error:
            self.metrics.errors.labels(self.model_label(request.model if request else ""), str(error.status)).inc()
            raise
        self.metrics.requests.labels(request.model).inc()
        self.metrics.count_pick(decision.endpoint.address)
        return request, decision

    def reroute(self, request: RoutingRequest, tried: str) -> Decision:
        """Pick again for a request whose attempt on `tried` failed before any response byte; raises
        RoutingError when no other endpoint can take it."""
        request.exclude = request.exclude | {tried}
        decision = self.picker.pick(request)
        self.metrics.count_pick(decision.endpoint.address)
        return decision

    def model_label(self, model: str) -> str:
        """`model` when an endpoint serves or is assigned it, else UNKNOWN_MODEL: clients choose names."""
        known = any(e.serves(model) or e.is_assigned(model) for e in self.picker.pool) if model else False
        return model if known else UNKNOWN_MODEL

    def body_for_engine(self, raw_body: bytes, request: RoutingRequest) -> bytes:
        """What the chosen engine receives: the client's body, with the engine's priority when forwarded."""
        return with_engine_priority(raw_body, request.priority) if self.forward_priority else raw_body
