"""The `hold` layer: a request for a model the gateway knows that has no ready engine waits for one
(hold.py: 503 with Retry-After when the hold is full or times out, or when the request's time budget runs out
first), asking for capacity (scale_up.py) in a cluster. Parameters: `maxHeld` (--hold-max), `timeout`
(--hold-timeout)."""
from __future__ import annotations

import asyncio
from typing import Any

from ...scheduling.picker import Decision, RoutingError
from ..deadline import TIMEOUT_HEADER, remaining_seconds
from ..framework import Admission, FlowHandle, FlowLayer
from ..hold import HoldQueue, HoldRefused
from ..registry import register_layer


@register_layer("hold")
class HoldLayer(FlowLayer):
    parameter_names = frozenset({"maxHeld", "timeout"})
    state = "queue"

    def __init__(self, parameters: dict[str, Any] | None = None, handle: FlowHandle | None = None,
                 state: HoldQueue | None = None) -> None:
        super().__init__(parameters, handle)
        router = self.handle.router
        self.queue = state if state is not None else HoldQueue(
            router.has_ready_endpoint, self.handle.scale_up, max_held=int(self.parameters.get("maxHeld", 256)),
            timeout=float(self.parameters.get("timeout", 120.0)), metrics=router.metrics)

    def holdable(self, model: str) -> bool:
        """A model the gateway knows (an InferenceModel, or an endpoint serving it that is not ready)."""
        router = self.handle.router
        return model in router.scalable or router.picker.knows(model)

    async def admit(self, admission: Admission) -> Decision | None:
        request, metrics = admission.request, self.handle.router.metrics
        if not request.model or not self.holdable(request.model):
            return None
        budget = remaining_seconds(request.deadline)
        waiting = self.queue.wait_until_ready(request.model)
        try:
            await (waiting if budget is None else asyncio.wait_for(waiting, max(0.0, budget)))
        except HoldRefused as refused:
            metrics.errors.labels(request.model, "503").inc()
            raise RoutingError(503, refused.message, retry_after=1) from None
        except TimeoutError:  # only the client's budget times the hold out this way
            metrics.errors.labels(request.model, "503").inc()
            raise RoutingError(503, f"the request's {TIMEOUT_HEADER} ran out while `{request.model}` had no "
                                    "ready engine", retry_after=1) from None
        return None
