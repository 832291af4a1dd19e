"""Admission per tenant, and the settling of each admitted request when it ends.

`TenantGate.admit` finds the tenant (401 when none), applies its limits (429 naming the limit, with
Retry-After) and hands back a Ticket. Whoever relays the response (the proxy, or ext_proc when Envoy
sends the response phases) feeds it the response and calls `finish` once, whatever the outcome: that
frees the concurrency slot, corrects the token charge to the reported usage and records the usage.
Without a tenants file the gate only accounts (for `--usage-log`), with no tenant and no limits.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from ..scheduling.picker import RoutingError, RoutingRequest
from .tenant_limits import Charge, TenantLimits, estimate_tokens
from .tenants import TenantDirectory
from .usage import UsageRecorder, UsageScanner, token_counts


class Ticket:
    def __init__(self, gate: TenantGate, tenant: str | None, charge: Charge | None, request: RoutingRequest,
                 weight: float = 1.0) -> None:
        self.gate, self.tenant, self.charge, self.request, self.weight = gate, tenant, charge, request, weight
        self.scanner = UsageScanner()
        self.status: int | None = None
        self.endpoint: str | None = None
        self.dispatched: float | None = None
        self.finished = False
        self._on_finish: list[Callable[[], None]] = []

    def on_finish(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the request ends (at once if it has)."""
        if self.finished:
            callback()
        else:
            self._on_finish.append(callback)

    def dispatched_to(self, endpoint: str) -> None:
        self.endpoint, self.dispatched = endpoint, time.perf_counter()

    def response_began(self, status: int) -> None:
        self.status = status

    def feed(self, chunk: bytes) -> None:
        self.scanner.feed(chunk)

    def finish(self, status: int | None = None) -> None:
        """Once per request; later calls do nothing. `status`: the final one, when known here."""
        if self.finished:
            return
        self.finished = True
        for callback in self._on_finish:
            callback()
        status = status or self.status
        usage = self.scanner.finish() if status and status < 400 else None
        counts = token_counts(usage)
        if self.charge is not None:
            # Refused or failed without usage: nothing ran, give the estimate back; else usage or estimate.
            used = counts[0] + counts[2] if counts else (0 if status and status >= 400 else None)
            self.gate.limits.settle(self.charge, used)
        seconds = time.perf_counter() - self.dispatched if self.dispatched is not None else None
        request = self.request
        self.gate.usage.record(tenant=self.tenant, model=self.gate.model_label(request.model), status=status,
                               usage=usage, seconds=seconds, requested_model=request.requested_model or None,
                               endpoint=self.endpoint)


class TenantGate:
    def __init__(self, directory: TenantDirectory | None, limits: TenantLimits, usage: UsageRecorder,
                 model_label: Callable[[str], str]) -> None:
        self.directory, self.limits, self.usage, self.model_label = directory, limits, usage, model_label

    def admit(self, headers: Mapping[str, str], request: RoutingRequest) -> Ticket:
        """Raises RoutingError: 401 (no tenant matches), 429 (over a limit)."""
        if self.directory is None:
            return Ticket(self, None, None, request)
        tenant = self.directory.identify(headers)
        try:
            # a request without a model (GET /v1/models through ext_proc) generates nothing
            tokens = 0 if not request.model else request.estimated_tokens if request.estimated_tokens is not None \
                else estimate_tokens(request.prompt, request.max_tokens)
            charge = self.limits.admit(tenant, tokens)
        except RoutingError as error:
            self.usage.record(tenant=tenant.name, model=self.model_label(request.model), status=error.status,
                              usage=None, seconds=None)
            raise
        return Ticket(self, tenant.name, charge, request, tenant.weight)
