"""Holding requests for a model that has no ready engine (scaled to zero, or still starting).

A request that finds no ready endpoint waits here instead of getting a 503: at most `max_held` per
model (beyond that, 503 with Retry-After), at most `timeout` seconds (then 503 with Retry-After).
The first held request of a model asks for capacity (`ask`: the InferenceModel's /scale subresource in
a cluster, sized by the number held); while nothing is ready, it asks again at most every
`REASK_SECONDS`, and only when more requests are held than at the last ask (a wake-up burst). Held
requests are released in arrival order as soon as the model has a ready endpoint; a client that goes
away while held just leaves the queue.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)
POLL_SECONDS = 0.02  # how often a model with held requests is checked for a ready endpoint (~10 us each)
REASK_SECONDS = 1.0  # the soonest a growing hold asks again (a GET of /scale, a PATCH when it grows)


class HoldRefused(Exception):
    """The request cannot be held (queue full) or waited too long; answer 503 with Retry-After."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass
class _ModelHold:
    waiters: deque[asyncio.Future] = field(default_factory=deque)
    releaser: asyncio.Task | None = None
    asked: bool = False  # a scale-up was asked and the model has not been ready since
    asked_for: int = 0  # requests held when it was last asked
    asked_at: float = 0.0
    asking: bool = False  # an ask is in flight


class HoldQueue:
    def __init__(self, ready: Callable[[str], bool], ask: Callable[[str, int], Awaitable[bool]] | None = None, *,
                 max_held: int = 256, timeout: float = 120.0, metrics=None) -> None:
        self.ready, self.ask = ready, ask
        self.max_held, self.timeout = max_held, timeout
        self.metrics = metrics  # GatewayMetrics: held gauge, hold-time histogram, scale-ups asked
        self._holds: dict[str, _ModelHold] = {}

    def held(self, model: str) -> int:
        hold = self._holds.get(model)
        return len(hold.waiters) if hold else 0

    async def wait_until_ready(self, model: str) -> float:
        """Returns at once when the model has a ready endpoint, else after holding; the seconds held.
        Raises HoldRefused (full, timed out); cancellation (the client left) propagates."""
        if self.ready(model):
            if model in self._holds:
                self._holds[model].asked = False  # up again: a later wake-up asks anew
            return 0.0
        hold = self._holds.setdefault(model, _ModelHold())
        if len(hold.waiters) >= self.max_held:
            raise HoldRefused(f"{self.max_held} requests for {model!r} are already waiting for an engine; retry later")
        started = time.monotonic()
        future = asyncio.get_running_loop().create_future()
        hold.waiters.append(future)
        self._count(+1)
        if hold.releaser is None or hold.releaser.done():
            hold.releaser = asyncio.create_task(self._release_when_ready(model, hold))
        self._ask_if_needed(model, hold)
        try:
            await asyncio.wait_for(asyncio.shield(future), self.timeout)
        except TimeoutError:
            raise HoldRefused(f"no engine for {model!r} became ready within {self.timeout:g} s; retry later") from None
        finally:
            if future in hold.waiters:
                hold.waiters.remove(future)
                self._count(-1)
            future.cancel()
        held = time.monotonic() - started
        if self.metrics is not None:
            self.metrics.hold_seconds.labels(model).observe(held)
        return held

    def _ask_if_needed(self, model: str, hold: _ModelHold) -> None:
        """The first held request asks; later, a hold that has grown since the last ask asks again."""
        if self.ask is None or hold.asking:
            return
        held, now = len(hold.waiters), time.monotonic()
        if hold.asked and (held <= hold.asked_for or now - hold.asked_at < REASK_SECONDS):
            return
        hold.asked, hold.asking, hold.asked_for, hold.asked_at = True, True, held, now
        asyncio.create_task(self._ask(model, hold, held))

    async def _release_when_ready(self, model: str, hold: _ModelHold) -> None:
        while hold.waiters:
            self._ask_if_needed(model, hold)
            if self.ready(model):
                hold.asked = False
                while hold.waiters:  # in arrival order
                    future = hold.waiters.popleft()
                    self._count(-1)
                    if not future.done():
                        future.set_result(None)
                return
            await asyncio.sleep(POLL_SECONDS)

    async def _ask(self, model: str, hold: _ModelHold, held: int) -> None:
        try:
            asked = await self.ask(model, held)
        except Exception:  # noqa: BLE001 - the hold goes on; its timeout answers the client
            logger.exception("asking for capacity for %s failed", model)
            hold.asked_for = 0  # asked again after REASK_SECONDS, not at every poll
            return
        finally:
            hold.asking = False
        if asked and self.metrics is not None:
            self.metrics.scale_ups.labels(model).inc()

    def _count(self, delta: int) -> None:
        if self.metrics is not None:
            self.metrics.held.inc(delta)
