"""One routing decision, shared by the ext_proc server and the proxy: parse, admit (tenants), fall
back, hold, wait in the fair queue when saturated, pick, count."""
from __future__ import annotations

import asyncio
import time
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import replace

from ..flowcontrol.deadline import TIMEOUT_HEADER, remaining_seconds
from ..flowcontrol.fallback import Fallbacks
from ..flowcontrol.hold import HoldQueue, HoldRefused
from ..scheduling.picker import Decision, Picker, RoutingError, RoutingRequest
from .engine_body import engine_body
from .metrics import UNKNOWN_MODEL, GatewayMetrics
from .request_info import engine_priority, parse_request

PARSE_ON_LOOP_BYTES = 64 << 10


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
        self.tenants = None  # tenant_gate.TenantGate: identifies, limits and accounts each request
        self.fallbacks = Fallbacks()
        self.fair_queue = None  # fair_queue.FairQueue: saturated models' requests wait at the gateway
        self.trust_priority_headers = False  # --trust-priority-headers: a hop in front sets them, not clients

    async def route_or_hold(self, raw_body: bytes, headers: Mapping[str, str], subset: frozenset[str] | None = None,
                            rewrite_body: bool = True) -> tuple[RoutingRequest, Decision]:
        """As `route`, after the tenant's admission (401, 429), and with a fallback model when the
        requested one cannot serve now (only when the caller can rewrite the body: `rewrite_body`). A
        request for a known model with no ready engine is held until one is ready (503 with Retry-After
        when the hold is full or times out); cancelling the caller ends the hold. The request's ticket,
        when routing fails, is settled here; otherwise the caller settles it when the response ends."""
        request = (self._parse(raw_body, headers) if len(raw_body) <= PARSE_ON_LOOP_BYTES  # a large one would
                   else await asyncio.to_thread(self._parse, raw_body, headers))  # stall every other request
        if self.tenants is not None:
            try:
                request.ticket = self.tenants.admit(headers, request)
            except RoutingError as error:
                self.metrics.errors.labels(self.model_label(request.model), str(error.status)).inc()
                raise
        try:
            precise = self.picker.precise  # admitted requests only: tokenizing a long prompt takes milliseconds,
            if precise is not None and request.body is not None and precise.index.block_sizes:  # off the loop
                await asyncio.to_thread(precise.tokenize, request)
            if rewrite_body and request.model:
                self._fall_back_if_unservable(request)
            if self.hold is not None and request.model and self._holdable(request.model):
                budget = remaining_seconds(request.deadline)
                waiting = self.hold.wait_until_ready(request.model)
                try:
                    await (waiting if budget is None else asyncio.wait_for(waiting, max(0.0, budget)))
                except HoldRefused as refused:
                    self.metrics.errors.labels(request.model, "503").inc()
                    raise RoutingError(503, refused.message, retry_after=1) from None
                except TimeoutError:  # only the client's budget times the hold out this way
                    self.metrics.errors.labels(request.model, "503").inc()
                    raise RoutingError(503, f"the request's {TIMEOUT_HEADER} ran out while `{request.model}` had no "
                                            "ready engine", retry_after=1) from None
            if self.fair_queue is not None:
                request.subset = subset
                if self.fair_queue.should_wait(request):
                    ticket = request.ticket
                    try:
                        decision = await self.fair_queue.wait(request, getattr(ticket, "tenant", None) or "",
                                                              getattr(ticket, "weight", 1.0))
                    except RoutingError as error:  # the tenant's queue bound, or its time budget
                        self.metrics.errors.labels(request.model, str(error.status)).inc()
                        raise
                    if decision is not None:  # else it waited its longest: routed as before
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

    def _serves_unsaturated(self, model: str) -> bool:
        return self.picker.has_ready(model, unsaturated=True)

    def _fall_back_if_unservable(self, request: RoutingRequest) -> None:
        """No ready pod, or every pod saturated: the first fallback with an unsaturated pod serves."""
        chain = self.fallbacks.of(request.model)
        if not chain or self._serves_unsaturated(request.model):
            return
        reason = "saturated" if self.has_ready_endpoint(request.model) else "no_ready_endpoint"
        alternative = next((m for m in chain if self._serves_unsaturated(m)), None)
        if alternative is not None:
            self._switch(request, alternative, reason)

    def _switch(self, request: RoutingRequest, model: str, reason: str) -> None:
        requested = request.requested_model or request.model
        request.requested_model, request.model, request.hashes = requested, model, None
        request.exclude = frozenset()
        self.metrics.fallbacks.labels(requested, model, reason).inc()

    def fall_back(self, request: RoutingRequest, tried: str) -> Decision | None:
        """After the request's model failed on every pod before any response byte: a pick on the next
        fallback that has a pod for it, the request switched to it; None when none can take it."""
        requested = request.requested_model or request.model
        chain = [requested, *self.fallbacks.of(requested)]
        position = chain.index(request.model) if request.model in chain else 0
        for model in chain[position + 1:]:
            candidate = replace(request, model=model, hashes=None, exclude=frozenset())
            try:
                decision = self.picker.pick(candidate)
            except RoutingError:
                continue
            self._switch(request, model, "failed")
            self.metrics.count_pick(decision.endpoint.address)
            if request.ticket is not None:
                request.ticket.dispatched_to(decision.endpoint.address)
            return decision
        return None

    def has_ready_endpoint(self, model: str) -> bool:
        return self.picker.has_ready(model)

    def _holdable(self, model: str) -> bool:
        """A model the gateway knows (an InferenceModel, or an endpoint serving it that is not ready)."""
        return model in self.scalable or self.picker.knows(model)

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
        if request.ticket is not None:
            request.ticket.dispatched_to(decision.endpoint.address)
            if self.fair_queue is not None and request.model:  # its share of the model's batch places
                request.ticket.on_finish(self.fair_queue.started(request.model, request.ticket.tenant or "",
                                                                  request.ticket.weight))
        return decision

    def reroute(self, request: RoutingRequest, tried: str) -> Decision:
        """Pick again for a request whose attempt on `tried` failed before any response byte; raises
        RoutingError when no other endpoint can take it."""
        request.exclude = request.exclude | {tried}
        decision = self.picker.pick(request)
        self.metrics.count_pick(decision.endpoint.address)
        if request.ticket is not None:
            request.ticket.dispatched_to(decision.endpoint.address)
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
