"""The `tokenize` layer: with --prefix-routing precise, an admitted request's prompt is tokenized off the event
loop (a long prompt takes milliseconds), before any hold or queue, so its pick does not stall other requests.
Left out of a composition, the precise scorer tokenizes on the loop at the pick instead."""
from __future__ import annotations

import asyncio

from ...scheduling.picker import Decision
from ..framework import Admission, FlowLayer
from ..registry import register_layer


@register_layer("tokenize")
class TokenizeLayer(FlowLayer):
    async def admit(self, admission: Admission) -> Decision | None:
        request, precise = admission.request, self.handle.router.picker.precise
        if precise is not None and request.body is not None and precise.index.block_sizes:
            await asyncio.to_thread(precise.tokenize, request)
        return None
