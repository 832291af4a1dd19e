"""A gateway queue for requests that find every pod of their model saturated.

Without it such a request is piled onto the least bad saturated pod, where it waits in the engine's
queue in arrival order: a tenant sending ten times its share takes ten times the places in front of
everyone else. Here it waits at the gateway instead, and is dispatched (picked onto a pod) as soon as a
pod of its model drops below the saturation thresholds and, where the engine reports its batch size
(max_num_seqs in /load), has a free place in its running batch: then the engine starts it at once and
all the queueing, the part fairness can reorder, happens here. In this order:
  * across tenants, weighted fair share: each tenant has a virtual time that a dispatch advances by
    1 / weight; the waiting tenant with the lowest goes first. A tenant that was idle starts at the
    current virtual time (no credit banked while idle).
  * within a tenant, higher priority first, then arrival order.
With `preempt` (engines that schedule by the priority the gateway forwards), a request does not wait
for a place to free when the fair share sends it ahead of another tenant's earlier one, or when its
tenant runs fewer of the model's requests than its weighted share of those running through this
gateway (shared among the tenants running or waiting for the model): it goes at once, its priority
raised by one, and the engine makes room by preempting a running request of lower priority
(recomputed later). So a tenant within its share waits for neither the backlog nor the batch, and
one past its share cannot keep the batch places it took while the pool was quiet.
Each model has its own queue, so a saturated model does not hold back another. Bounds: at most
`max_per_tenant` requests of a tenant wait (beyond that, 429 with Retry-After), at most `timeout`
seconds each; then the request is routed as before, onto a saturated pod (the queue never turns
work away for being slow, it only reorders). Sheddable requests never wait: the picker sheds them (429).
Without tenants every request is one tenant's: priority, then arrival order.
A request with a time budget (deadline.py) is refused at once (429) when the expected wait, from the
model's recent dispatch rate, exceeds what is left of it, and gets a 503 when it runs out while waiting.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..scheduling.picker import Decision, Picker, RoutingError, RoutingRequest
from .deadline import TIMEOUT_HEADER, remaining_seconds

POLL_SECONDS = 0.01  # how often a model with waiting requests is checked for a free pod
RATE_WINDOW = 32  # recent dispatches the expected wait is measured on
STALE_RATE = 30.0  # seconds after the last dispatch when the measured rate no longer says anything


@dataclass(order=True)
class _Waiter:
    order: tuple[int, int]  # (-priority, arrival): higher priority first, then first come
    request: RoutingRequest = field(compare=False)
    tenant: str = field(compare=False)
    future: asyncio.Future = field(compare=False)


class FairQueue:
    def __init__(self, picker: Picker, *, max_per_tenant: int = 128, timeout: float = 30.0, metrics=None,
                 preempt: bool = False) -> None:
        """`preempt`: the engines run --scheduling-policy priority and get the gateway's priority
        (--forward-priority), so a request sent with a higher priority takes a running one's place."""
        self.picker, self.max_per_tenant, self.timeout, self.metrics = picker, max_per_tenant, timeout, metrics
        self.preempt = preempt
        self._queues: dict[str, dict[str, list[_Waiter]]] = defaultdict(dict)  # model -> tenant -> heap
        self._per_tenant: dict[str, int] = defaultdict(int)
        self._virtual: dict[str, float] = defaultdict(float)  # tenant -> virtual time
        self._weights: dict[str, float] = {}
        self._now = 0.0  # the virtual time of the last dispatch
        self._arrivals = itertools.count()
        self._dispatchers: dict[str, asyncio.Task] = {}
        self._dispatched: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=RATE_WINDOW))
        self._running: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # model -> tenant -> n

    def started(self, model: str, tenant: str, weight: float = 1.0) -> Callable[[], None]:
        """A request of `tenant` runs on a pod of `model` (queued or not); call the result when it ends."""
        self._weights[tenant] = weight
        running = self._running[model]
        running[tenant] += 1
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                running[tenant] -= 1

        return end

    def running(self, model: str, tenant: str) -> int:
        return self._running[model][tenant]

    def expected_wait(self, model: str) -> float | None:
        """Seconds a request joining the model's queue now should wait, by the recent dispatch rate;
        None while the rate is unknown (fewer than two recent dispatches)."""
        times = self._dispatched.get(model)
        if not times or len(times) < 2 or times[-1] - times[0] <= 0 or time.monotonic() - times[-1] > STALE_RATE:
            return None
        rate = (len(times) - 1) / (times[-1] - times[0])
        return (self.waiting(model) + 1) / rate

    def waiting(self, model: str | None = None) -> int:
        models = [model] if model is not None else list(self._queues)
        return sum(len(h) for m in models for h in self._queues.get(m, {}).values())

    def has_free_pod(self, request: RoutingRequest) -> bool:
        return bool(self.picker.has_free_endpoint(request, free_slot=True))

    def should_wait(self, request: RoutingRequest) -> bool:
        """Every pod of the model is saturated, or others already wait for it (no overtaking)."""
        if request.sheddable or not request.model:
            return False
        free = self.picker.has_free_endpoint(request, free_slot=True)  # None: no ready pod serves it
        return free is not None and (self.waiting(request.model) > 0 or not free)

    async def wait(self, request: RoutingRequest, tenant: str = "", weight: float = 1.0) -> Decision | None:
        """The decision once a pod is free; None after `timeout` (route as before). RoutingError(429)
        when the tenant already has `max_per_tenant` waiting; cancellation (the client left) leaves."""
        if self._per_tenant[tenant] >= self.max_per_tenant:
            raise RoutingError(429, f"{self.max_per_tenant} requests of tenant {tenant or 'default'!r} already wait "
                                    f"for a free pod of `{request.model}`; retry later", retry_after=1)
        budget = remaining_seconds(request.deadline)
        expected = self.expected_wait(request.model)
        if budget is not None and expected is not None and expected > budget:
            raise RoutingError(429, f"waiting for a free pod of `{request.model}` would take about {expected:.1f} s, "
                                    f"more than the {max(0, budget * 1000):.0f} ms left of the request's "
                                    f"{TIMEOUT_HEADER}", retry_after=max(1, math.ceil(expected)))
        self._weights[tenant] = weight
        heaps = self._queues[request.model]
        if not heaps.get(tenant):  # (re)joining the backlog: no credit for the time it was idle
            self._virtual[tenant] = max(self._virtual[tenant], self._now)
        waiter = _Waiter((-request.priority, next(self._arrivals)), request, tenant,
                         asyncio.get_running_loop().create_future())
        heapq.heappush(heaps.setdefault(tenant, []), waiter)
        self._count(tenant, +1)
        dispatcher = self._dispatchers.get(request.model)
        if dispatcher is None or dispatcher.done():
            self._dispatchers[request.model] = asyncio.create_task(self._dispatch(request.model))
        limit = self.timeout if budget is None else min(self.timeout, max(0.0, budget))
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), limit)
        except TimeoutError:
            if budget is not None and limit < self.timeout:
                raise RoutingError(503, f"the request's {TIMEOUT_HEADER} ran out while it waited for a free pod of "
                                        f"`{request.model}`", retry_after=1) from None
            return None
        finally:
            if not waiter.future.done():  # timed out or cancelled: leave the queue
                waiter.future.cancel()
                heap = heaps.get(tenant, [])
                if waiter in heap:
                    heap.remove(waiter)
                    heapq.heapify(heap)
                    self._count(tenant, -1)
            elif waiter.future.cancelled() is False and waiter.future.exception() is None and \
                    asyncio.current_task().cancelling():  # dispatched as the client left: undo the pick
                decision = waiter.future.result()
                decision.endpoint.record_finish(decision.sent)

    async def _dispatch(self, model: str) -> None:
        heaps = self._queues[model]
        while any(heaps.values()):
            while (chosen := self._next(model, heaps)) is not None:
                tenant, raised = chosen
                waiter = heaps[tenant][0]
                if raised:
                    waiter.request.priority += 1  # its place comes from a tenant past its share
                heapq.heappop(heaps[tenant])
                self._count(tenant, -1)
                self._dispatched[model].append(time.monotonic())
                self._now = self._virtual[tenant]
                self._virtual[tenant] += 1.0 / self._weights.get(tenant, 1.0)
                try:
                    waiter.future.set_result(self.picker.pick(waiter.request, free_slot=True))
                except RoutingError as error:
                    waiter.future.set_exception(error)
            await asyncio.sleep(POLL_SECONDS)
        self._queues.pop(model, None)

    def _next(self, model: str, heaps: dict[str, list[_Waiter]]) -> tuple[str, bool] | None:
        """The tenant whose request goes next, and whether it goes one priority up: the one with the
        lowest virtual time while a pod has room (the model's pods are shared: when its request does
        not fit, none does); else, with `preempt`, that tenant when it overtakes another's earlier
        request, or the first in that order below its share of the running requests. A request
        entitled to a place goes up even when a place looks free: the gateway's view of the batches
        lags, and at equal priority a request that finds the batch full would wait for it to drain."""
        tenants = sorted((t for t, heap in heaps.items() if heap), key=lambda t: (self._virtual[t], t))
        if not tenants:
            return None
        head = tenants[0]
        if self.has_free_pod(heaps[head][0].request):
            return head, self._entitled(model, heaps, head)
        if self._entitled(model, heaps, head):
            return head, True
        return next(((tenant, True) for tenant in tenants[1:] if self.preempt
                     and self._below_share(model, heaps, tenant)), None)

    def _entitled(self, model: str, heaps: dict[str, list[_Waiter]], tenant: str) -> bool:
        """With `preempt`: fair share sends the tenant's request ahead of another's earlier one, or the
        tenant runs less than its share."""
        return self.preempt and (self._overtakes(heaps, tenant, heaps[tenant][0])
                                 or self._below_share(model, heaps, tenant))

    @staticmethod
    def _overtakes(heaps: dict[str, list[_Waiter]], tenant: str, waiter: _Waiter) -> bool:
        """Another tenant's request waits since before this one: fair share, not arrival, sends it next."""
        return any(heap[0].order[1] < waiter.order[1] for other, heap in heaps.items() if other != tenant and heap)

    def _below_share(self, model: str, heaps: dict[str, list[_Waiter]], tenant: str) -> bool:
        """The tenant runs fewer of the model's requests than its weighted share of those this gateway
        has running, shared among the tenants running or waiting: another tenant holds places fair
        share would give it. Only this replica's requests count, so with several gateway replicas each
        judges by its own part of the traffic, and a tenant alone never preempts itself."""
        running = self._running[model]
        active = {t for t, n in running.items() if n > 0} | {t for t, heap in heaps.items() if heap}
        weights = sum(self._weights.get(t, 1.0) for t in active)
        return running[tenant] < sum(running.values()) * self._weights.get(tenant, 1.0) / weights

    def _count(self, tenant: str, delta: int) -> None:
        self._per_tenant[tenant] += delta
        if self.metrics is not None:
            self.metrics.queued.inc(delta)
