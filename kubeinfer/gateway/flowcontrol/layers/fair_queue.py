"""The `fair-queue` layer: a request that finds every pod of its model saturated waits at the gateway and is
dispatched by weighted fair share across tenants, priority first within one (fair_queue.py); the queue's
dispatch is its pick. Its share of the model's running requests is counted until the request ends (with a
ticket: after the tenants layer). Parameters: `maxPerTenant` (--fair-queue-max-per-tenant), `timeout`
(--fair-queue-timeout), `preempt` (--forward-priority)."""
from __future__ import annotations

from typing import Any

from ...scheduling.picker import Decision, RoutingError, RoutingRequest
from ..fair_queue import FairQueue
from ..framework import Admission, FlowHandle, FlowLayer
from ..registry import register_layer


@register_layer("fair-queue")
class FairQueueLayer(FlowLayer):
    parameter_names = frozenset({"maxPerTenant", "timeout", "preempt"})
    state = "queue"

    def __init__(self, parameters: dict[str, Any] | None = None, handle: FlowHandle | None = None,
                 state: FairQueue | None = None) -> None:
        super().__init__(parameters, handle)
        router = self.handle.router
        self.queue = state if state is not None else FairQueue(
            router.picker, max_per_tenant=int(self.parameters.get("maxPerTenant", 128)),
            timeout=float(self.parameters.get("timeout", 30.0)), metrics=router.metrics,
            preempt=bool(self.parameters.get("preempt", False)))

    async def admit(self, admission: Admission) -> Decision | None:
        request = admission.request
        request.subset = admission.subset
        if not self.queue.should_wait(request):
            return None
        ticket = request.ticket
        try:
            return await self.queue.wait(request, getattr(ticket, "tenant", None) or "", getattr(ticket, "weight", 1.0))
        except RoutingError as error:  # the tenant's queue bound, or its time budget
            self.handle.router.metrics.errors.labels(request.model, str(error.status)).inc()
            raise

    def dispatched(self, request: RoutingRequest, decision: Decision, retry: bool) -> None:
        if not retry and request.ticket is not None and request.model:  # its share of the model's batch places
            ticket = request.ticket
            ticket.on_finish(self.queue.started(request.model, ticket.tenant or "", ticket.weight))
