"""One routing decision, shared by the ext_proc server and the proxy: parse, pass the flow-control layers in
their composition's order (flowcontrol/composition.py; by default: tenants, tokenize, fallback, hold, fair
queue), pick, count."""
from __future__ import annotations

import asyncio
import time
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import replace

from ..flowcontrol.composition import FlowControl, LayerSlot
from ..flowcontrol.fallback import Fallbacks, switch_model
from ..flowcontrol.framework import Admission, FlowHandle
from ..flowcontrol.registry import create
from ..scheduling.picker import Decision, Picker, RoutingError, RoutingRequest
from .engine_body import engine_body
from .metrics import UNKNOWN_MODEL, GatewayMetrics
from .request_info import engine_priority, parse_request

PARSE_ON_LOOP_BYTES = 64 << 10


class Router:
    # The state of the composed layers, by name (None when the layer is not composed); setting one composes it.
    tenants = LayerSlot("tenants")  # tenant_gate.TenantGate: identifies, limits and accounts each request
    hold = LayerSlot("hold")  # hold.HoldQueue: requests for a model with no ready engine wait
    fair_queue = LayerSlot("fair-queue")  # fair_queue.FairQueue: saturated models' requests wait at the gateway

    def __init__(self, picker: Picker, metrics: GatewayMetrics | None = None,
                 model_priorities: Mapping[str, int] | None = None, forward_priority: bool = False) -> None:
        self.picker = picker
        self.forward_priority = forward_priority
        self.metrics = metrics or GatewayMetrics(picker)
        self.model_priorities = dict(model_priorities or {})  # configured: wins
        self.discovered_priorities: dict[str, int] = {}  # from InferenceModels in the cluster
        self.objective_priorities: dict[str, int] = {}  # from the Inference Extension's InferenceObjectives
        self.scalable: set[str] | dict = set()  # served names an InferenceModel can bring back from zero
        self.fallbacks = Fallbacks()  # each model's, static and from InferenceModels (the fallback layer's data)
        self.trust_priority_headers = False  # --trust-priority-headers: a hop in front sets them, not clients
        self.flow_handle = FlowHandle(self)
        # The gateway composes the flow from its flags or its config (app.py); a bare router has the layers that
        # need no setting, and gets the others by the slots above.
        self.flow = FlowControl([create(name, {}, self.flow_handle) for name in ("tokenize", "fallback")])

    async def route_or_hold(self, raw_body: bytes, headers: Mapping[str, str], subset: frozenset[str] | None = None,
                            rewrite_body: bool = True) -> tuple[RoutingRequest, Decision]:
        """As `route`, after the flow-control layers (`self.flow`), by default: the tenant's admission (401,
        429); a fallback model when the requested one cannot serve now (only when the caller can rewrite the
        body: `rewrite_body`); a hold until a known model with no ready engine has one (503 with Retry-After
        when the hold is full or times out); the fair queue while every pod is saturated. Cancelling the
        caller ends a wait. The request's ticket, when routing fails, is settled here; otherwise the caller
        settles it when the response ends."""
        request = (self._parse(raw_body, headers) if len(raw_body) <= PARSE_ON_LOOP_BYTES  # a large one would
                   else await asyncio.to_thread(self._parse, raw_body, headers))  # stall every other request
        try:
            decision = await self.flow.admit(Admission(request, headers, subset, rewrite_body))
            if decision is not None:  # a layer picked (the fair queue, as it dispatched the request)
                return request, self._routed(request, decision)
            return self.route(raw_body, headers, subset, request)
        except RoutingError as error:
            if request.ticket is not None:
                request.ticket.finish(error.status)
            raise
        except BaseException:  # cancelled while held: the client left
            if request.ticket is not None:
                request.ticket.finish(499)
            raise

    def fall_back(self, request: RoutingRequest, tried: str) -> Decision | None:
        """After the request's model failed on every pod before any response byte: a pick on the next
        fallback that has a pod for it, the request switched to it; None when none can take it."""
        if "fallback" not in self.flow:
            return None
        requested = request.requested_model or request.model
        chain = [requested, *self.fallbacks.of(requested)]
        position = chain.index(request.model) if request.model in chain else 0
        for model in chain[position + 1:]:
            candidate = replace(request, model=model, hashes=None, exclude=frozenset())
            try:
                decision = self.picker.pick(candidate)
            except RoutingError:
                continue
            switch_model(request, model, "failed", self.metrics)
            self.metrics.count_pick(decision.endpoint.address)
            self.flow.dispatched(request, decision, retry=True)
            return decision
        return None

    def has_ready_endpoint(self, model: str) -> bool:
        return self.picker.has_ready(model)

    def _parse(self, raw_body: bytes, headers: Mapping[str, str]) -> RoutingRequest:
        try:
            return parse_request(raw_body, headers, ChainMap(self.model_priorities, self.discovered_priorities),
                                 self.objective_priorities, self.trust_priority_headers,
                                 keep_body=self.picker.precise is not None)
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
                                               self.objective_priorities, self.trust_priority_headers,
                                               keep_body=self.picker.precise is not None)
            request.subset = subset
            start = time.perf_counter()
            decision = self.picker.pick(request)
            self.metrics.pick_duration.observe(time.perf_counter() - start)
        except RoutingError as error:
            self.metrics.errors.labels(self.model_label(request.model if request else ""), str(error.status)).inc()
            raise
        return request, self._routed(request, decision)

    def _routed(self, request: RoutingRequest, decision: Decision) -> Decision:
        self.metrics.requests.labels(request.model).inc()
        self.metrics.count_pick(decision.endpoint.address)
        self.flow.dispatched(request, decision)
        return decision

    def reroute(self, request: RoutingRequest, tried: str) -> Decision:
        """Pick again for a request whose attempt on `tried` failed before any response byte; raises
        RoutingError when no other endpoint can take it."""
        request.exclude = request.exclude | {tried}
        decision = self.picker.pick(request)
        self.metrics.count_pick(decision.endpoint.address)
        self.flow.dispatched(request, decision, retry=True)
        return decision

    def model_label(self, model: str) -> str:
        """`model` when an endpoint serves or is assigned it, else UNKNOWN_MODEL: clients choose names."""
        return model if model and self.picker.knows(model) else UNKNOWN_MODEL

    def body_for_engine(self, raw_body: bytes, request: RoutingRequest, add_usage: bool = True) -> bytes:
        """What the chosen engine receives (engine_body.py): the engine's priority when forwarded (else no
        client-written one), the fallback's name as `model` when a fallback serves it, and a stream's usage
        asked for when the client did not and usage is accounted (the caller strips it from the response:
        `add_usage` says it can)."""
        fallback = request.requested_model and request.requested_model != request.model
        return engine_body(raw_body, priority=engine_priority(request.priority) if self.forward_priority else None,
                           model=request.model if fallback else None,
                           add_usage=add_usage and request.add_usage and request.ticket is not None)
