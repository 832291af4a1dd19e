"""Flow control's interface: the layers a request passes, in their composition's order, before the pick.

A FlowLayer decides whether and when a request may be scheduled. The router (handlers/routing.py) calls, for
each request:

  * `admit(admission)`, layer by layer in order, before the pick: a layer lets the request pass (returns None),
    refuses it (raises RoutingError: 401, 429, 503, with the status the client gets), makes it wait (holds it
    until its model has a ready engine, queues it while every pod is saturated), changes it (a fallback model),
    or schedules it itself (returns the Decision: the fair queue picks as it dispatches; the layers after it
    and the router's own pick are then skipped);
  * `dispatched(request, decision, retry)` once a pick is made: the request's first (`retry` False), and each
    pick again after an attempt failed before any response byte (proxy mode: another pod, or a fallback);
  * `close()` when the gateway stops.

What a request holds across its response is its ticket (`RoutingRequest.ticket`, the `Ticket` protocol below),
given by the layer that admits it (the tenants layer: tenant_gate.Ticket). The handlers feed the ticket the
response (`response_began`, `feed`: the on-response hooks) and settle it exactly once (`finish`: the release,
whatever the outcome); a layer that must hear the end of a request registers `ticket.on_finish(callback)`.

Layers are registered by type name (registry.py) and built as `factory(parameters, handle)`: `parameters` are
the composition's for that layer (each defaults to its flag), `handle` what the gateway shares with them.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..scheduling.picker import Decision, RoutingRequest


@dataclass
class Admission:
    """One request on its way through the layers."""
    request: RoutingRequest
    headers: Mapping[str, str]  # lower-case names
    subset: frozenset[str] | None = None  # the data plane's subset hint: the only endpoints it may go to
    rewrite_body: bool = True  # the caller can rewrite the body (so a fallback model may serve it)


class Ticket(Protocol):
    """A request's state across its response, settled once by whoever relays the response."""

    def response_began(self, status: int) -> None: ...

    def feed(self, chunk: bytes) -> None: ...

    def finish(self, status: int | None = None) -> None: ...

    def on_finish(self, callback: Callable[[], None]) -> None: ...

    def dispatched_to(self, endpoint: str) -> None: ...


@dataclass
class FlowHandle:
    """What the gateway shares with the layers it builds. `router` is the handlers' Router (not imported here:
    flow control sits below the handlers): its `picker`, `metrics` (GatewayMetrics), `model_label`,
    `fallbacks` (fallback.Fallbacks) and `scalable` (the models an InferenceModel can bring back from zero)."""
    router: Any
    scale_up: Callable[..., Any] | None = None  # scale_up.ScaleUp in a cluster: asks an InferenceModel for pods


class FlowLayer:
    """One flow-control layer. A layer whose state can be handed in (a test's, or the router's attributes: see
    composition.LayerSlot) names it in `state` and takes it as the `state` argument."""
    type_name = ""  # set by the registry
    parameter_names: frozenset[str] = frozenset()  # the parameters a composition may give it
    state: str | None = None  # the attribute holding the layer's state object, if any

    def __init__(self, parameters: dict[str, Any] | None = None, handle: FlowHandle | None = None,
                 state: Any = None) -> None:
        self.parameters = dict(parameters or {})
        if handle is None:
            raise ValueError(f"flow-control layer `{self.type_name}` needs the gateway's handle")
        self.handle = handle

    async def admit(self, admission: Admission) -> Decision | None:
        return None

    def dispatched(self, request: RoutingRequest, decision: Decision, retry: bool) -> None:
        pass

    def close(self) -> None:
        pass
