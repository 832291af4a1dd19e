"""One routing decision, shared by the ext_proc server and the proxy: parse, pick, count."""
from __future__ import annotations

import time
from collections import ChainMap
from collections.abc import Mapping

from .hold import HoldQueue, HoldRefused
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
        self.hold: HoldQueue | None = None  # set by the gateway: requests for a model with no ready engine wait
        self.scalable: set[str] | dict = set()  # served names an InferenceModel can bring back from zero

    async def route_or_hold(self, raw_body: bytes, headers: Mapping[str, str],
                            subset: frozenset[str] | None = None) -> tuple[RoutingRequest, Decision]:
        """As `route`, but a request for a known model with no ready engine is held until one is ready
        (503 with Retry-After when the hold is full or times out); cancelling the caller ends the hold."""
        request = self._parse(raw_body, headers)
        if self.hold is not None and request.model and self._holdable(request.model):
            try:
                await self.hold.wait_until_ready(request.model)
            except HoldRefused as refused:
                self.metrics.errors.labels(request.model, "503").inc()
                raise RoutingError(503, refused.message) from None
        return self.route(raw_body, headers, subset, request)

    def has_ready_endpoint(self, model: str) -> bool:
        return any(e.serves(model) or e.is_assigned(model) for e in self.picker.ready_endpoints())

    def _holdable(self, model: str) -> bool:
        """A model the gateway knows (an InferenceModel, or an endpoint serving it that is not ready)."""
        return model in self.scalable or any(e.serves(model) or e.is_assigned(model) for e in self.picker.pool)

    def _parse(self, raw_body: bytes, headers: Mapping[str, str]) -> RoutingRequest:
        try:
            return parse_request(raw_body, headers, ChainMap(self.model_priorities, self.discovered_priorities),
                                 self.objective_priorities)
        except RoutingError as error:
            self.metrics.errors.labels(UNKNOWN_MODEL, str(error.status)).inc()
            raise

    def route(self, raw_body: bytes, headers: Mapping[str, str], subset: frozenset[str] | None = None,
              request: RoutingRequest | None = None) -> tuple[RoutingRequest, Decision]:
        """Raises RoutingError with the HTTP status to answer (400, 404, 429, 503). `subset`: the only
        endpoints (ip:port) the data plane allows for this request; `request`: the body already parsed."""
        try:
            request = request or parse_request(raw_body, headers,
                                               ChainMap(self.model_priorities, self.discovered_priorities),
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
