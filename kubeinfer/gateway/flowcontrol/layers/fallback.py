"""The `fallback` layer: a request whose model has no ready pod, or only saturated ones, goes to the first of
the model's fallbacks (--fallback, an InferenceModel's `spec.routing.fallback`: the router's `fallbacks`) that
has an unsaturated pod; only when the caller can rewrite the body (its `model`). Composed, it also lets the proxy
move a request that failed on every pod of its model to a fallback (Router.fall_back)."""
from __future__ import annotations

from ...scheduling.picker import Decision
from ..fallback import switch_model
from ..framework import Admission, FlowLayer
from ..registry import register_layer


@register_layer("fallback")
class FallbackLayer(FlowLayer):
    async def admit(self, admission: Admission) -> Decision | None:
        request, router = admission.request, self.handle.router
        if not admission.rewrite_body or not request.model:
            return None
        chain = router.fallbacks.of(request.model)
        picker = router.picker
        if not chain or picker.has_ready(request.model, unsaturated=True):
            return None
        reason = "saturated" if picker.has_ready(request.model) else "no_ready_endpoint"
        alternative = next((m for m in chain if picker.has_ready(m, unsaturated=True)), None)
        if alternative is not None:
            switch_model(request, alternative, reason, router.metrics)
        return None
