"""The `tenants` layer: identifies each request's tenant (401 when none), applies its limits (429) and gives the
request its ticket, which settles the token charge and records the usage when the response ends
(tenant_gate.py). Parameters (each defaults to its flag): `file` (--tenants), `trustHeader`
(--trust-tenant-header), `limitScope` (--tenant-limit-scope), `replicas` (--gateway-replicas), `usageLog`
(--usage-log). Without a tenants file it only accounts, for the usage log."""
from __future__ import annotations

from typing import Any

from ...scheduling.picker import Decision, RoutingError, RoutingRequest
from ..framework import Admission, FlowHandle, FlowLayer
from ..registry import register_layer
from ..tenant_gate import TenantGate
from ..tenant_limits import TenantLimits
from ..tenants import TenantDirectory
from ..usage import UsageRecorder


@register_layer("tenants")
class TenantsLayer(FlowLayer):
    parameter_names = frozenset({"file", "trustHeader", "limitScope", "replicas", "usageLog"})
    state = "gate"

    def __init__(self, parameters: dict[str, Any] | None = None, handle: FlowHandle | None = None,
                 state: TenantGate | None = None) -> None:
        super().__init__(parameters, handle)
        self.metrics, self.model_label = self.handle.router.metrics, self.handle.router.model_label
        self.gate = state if state is not None else self._gate()

    def _gate(self) -> TenantGate:
        file, log = self.parameters.get("file"), self.parameters.get("usageLog")
        if not file and not log:
            raise ValueError("the tenants layer needs a tenants file or a usage log (--tenants, --usage-log, or "
                             "its `file` / `usageLog` parameter)")
        directory = TenantDirectory(file, bool(self.parameters.get("trustHeader", False))) if file else None
        limits = TenantLimits(self.parameters.get("limitScope", "replica"), int(self.parameters.get("replicas", 1)))
        return TenantGate(directory, limits, UsageRecorder(self.metrics, log), self.model_label)

    async def admit(self, admission: Admission) -> Decision | None:
        request = admission.request
        try:
            request.ticket = self.gate.admit(admission.headers, request)
        except RoutingError as error:
            self.metrics.errors.labels(self.model_label(request.model), str(error.status)).inc()
            raise
        return None

    def dispatched(self, request: RoutingRequest, decision: Decision, retry: bool) -> None:
        if request.ticket is not None:
            request.ticket.dispatched_to(decision.endpoint.address)

    def close(self) -> None:
        self.gate.usage.close()
