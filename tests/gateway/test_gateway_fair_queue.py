"""The fair queue: requests that find every pod of their model saturated wait at the gateway and are
dispatched by weighted fair share across tenants, priority first within a tenant, bounded per tenant;
sheddable requests are still shed. Unit tests on the queue, then proxy and ext_proc end to end."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest
from test_gateway_tenants import (Engine, _immediate, _request, _run, answer_with_usage, drop_connection, metrics_text, post,
                                  start_gateway, write_tenants)

from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool, EngineState
from kubeinfer.gateway.flowcontrol.fair_queue import FairQueue
from kubeinfer.gateway.scheduling.picker import Picker, PickerConfig, RoutingError, RoutingRequest


def saturated_pool(waiting: float = 5.0) -> tuple[Picker, Endpoint]:
    pod = Endpoint("10.0.0.1:8000")
    pod.record_scrape(EngineState(waiting=waiting), frozenset({"base"}), frozenset({"base"}))
    pool = EndpointPool()
    pool.set_members([pod])
    return Picker(pool, PickerConfig(queue_threshold=5)), pod


async def drain(queue: FairQueue, pod: Endpoint, requests: list[tuple[str, float, int]]) -> list[tuple[str, int]]:
    """Queues (tenant, weight, priority) requests in order on a saturated pod, then frees one slot:
    each dispatched request ends at once, so they go one at a time. Returns the dispatch order."""
    order: list[tuple[str, int]] = []

    async def one(tenant: str, weight: float, priority: int) -> None:
        decision = await queue.wait(RoutingRequest(model="base", priority=priority), tenant, weight)
        order.append((tenant, priority))
        decision.endpoint.record_finish(decision.sent)

    tasks = [asyncio.create_task(one(*r)) for r in requests]
    await asyncio.sleep(0.05)
    assert order == [] and queue.waiting("base") == len(requests)
    pod.state = EngineState(waiting=4)  # one free slot
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    return order


async def test_tenants_share_by_weight_whatever_the_arrival_order():
    picker, pod = saturated_pool()
    order = await drain(FairQueue(picker), pod, [("noisy", 1, 0)] * 6 + [("quiet", 2, 0)] * 4)
    tenants = [t for t, _ in order]
    # the quiet tenant arrived last with twice the weight: two of its requests for each noisy one
    assert tenants[:6] == ["noisy", "quiet", "quiet", "noisy", "quiet", "quiet"]
    assert tenants[6:] == ["noisy"] * 4


async def test_a_full_running_batch_holds_requests_at_the_gateway_before_any_engine_queue():
    """An engine that reports its batch size (max_num_seqs in /load) and has every place taken is not
    free, though nothing waits in it yet: the request waits here, where the order is fair, and goes as
    soon as a place frees."""
    picker, pod = saturated_pool(waiting=0)
    pod.state = EngineState(running=4, max_running=4)
    queue = FairQueue(picker)
    assert queue.should_wait(RoutingRequest(model="base"))
    task = asyncio.create_task(queue.wait(RoutingRequest(model="base"), "a"))
    await asyncio.sleep(0.05)
    assert not task.done()
    pod.state = EngineState(running=3, max_running=4)
    decision = await asyncio.wait_for(task, 5)
    assert decision.endpoint is pod
    pod.state = EngineState(running=0, max_running=0)  # an engine that does not say: the thresholds alone
    assert not queue.should_wait(RoutingRequest(model="base"))


async def test_with_preemption_a_tenant_within_its_share_goes_at_once_with_a_raised_priority():
    """Engines that schedule by the forwarded priority can make room: the quiet tenant's request, sent
    ahead of the noisy backlog by the fair share, does not wait for a place, and goes one priority up
    (its place comes from a running request of the noisy tenant). The noisy backlog still waits."""
    picker, pod = saturated_pool(waiting=0)
    pod.state = EngineState(running=4, max_running=4)
    queue = FairQueue(picker, preempt=True)
    noisy = [asyncio.create_task(queue.wait(RoutingRequest(model="base"), "noisy")) for _ in range(5)]
    await asyncio.sleep(0.05)
    pod.state = EngineState(running=2, max_running=4)  # two places free: the noisy tenant takes them
    await asyncio.sleep(0.05)
    pod.state = EngineState(running=4, max_running=4)
    assert sum(task.done() for task in noisy) == 2
    noisy = [task for task in noisy if not task.done()]
    quiet_request = RoutingRequest(model="base")
    decision = await asyncio.wait_for(queue.wait(quiet_request, "quiet"), 1)
    assert decision.endpoint is pod and quiet_request.priority == 1
    assert not any(task.done() for task in noisy) and queue.waiting("base") == 3
    without = FairQueue(picker)  # engines that cannot preempt: the quiet request waits for a place
    waiting = asyncio.create_task(without.wait(RoutingRequest(model="base"), "quiet"))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    for task in [*noisy, waiting]:
        task.cancel()


async def test_with_preemption_a_tenant_below_its_share_of_the_running_requests_goes_at_once():
    """No backlog to overtake, but the noisy tenant holds all four places of a full batch: the quiet
    tenant's share is two of them, so its request goes at once, one priority up. A tenant never takes
    places from itself: the noisy tenant's next request waits, and so does the quiet one's once it runs
    its share. Without preemption the quiet request waits for a place."""
    picker, pod = saturated_pool(waiting=0)
    pod.state = EngineState(running=4, max_running=4)
    queue = FairQueue(picker, preempt=True)
    noisy_running = [queue.started("base", "noisy") for _ in range(4)]
    noisy = asyncio.create_task(queue.wait(RoutingRequest(model="base"), "noisy"))
    await asyncio.sleep(0.05)
    assert not noisy.done()
    quiet_request = RoutingRequest(model="base")
    decision = await asyncio.wait_for(queue.wait(quiet_request, "quiet"), 1)
    assert decision.endpoint is pod and quiet_request.priority == 1 and not noisy.done()
    quiet_running = [queue.started("base", "quiet"), queue.started("base", "quiet")]  # as the router counts
    for end in [noisy_running[0], noisy_running[0], noisy_running[1]]:  # two ended (one told twice)
        end()
    assert queue.running("base", "noisy") == 2 and queue.running("base", "quiet") == 2
    second = asyncio.create_task(queue.wait(RoutingRequest(model="base"), "quiet"))
    await asyncio.sleep(0.05)
    assert not second.done()  # 2 of 4 running: its share, no more
    without = FairQueue(picker)
    for _ in range(4):
        without.started("base", "noisy")
    waiting = asyncio.create_task(without.wait(RoutingRequest(model="base"), "quiet"))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    for task in [noisy, second, waiting]:
        task.cancel()
    del quiet_running


async def test_with_preemption_a_request_entitled_to_a_place_goes_up_even_when_one_looks_free():
    """The gateway's view of the batches lags: a quiet request that finds the batch full at equal
    priority would wait for it to drain. Entitled (below its share), it goes up; the noisy tenant's
    next request, past its share, keeps its priority."""
    picker, pod = saturated_pool(waiting=0)
    pod.state = EngineState(running=1, max_running=4)  # places look free
    queue = FairQueue(picker, preempt=True)
    for _ in range(4):
        queue.started("base", "noisy")
    noisy, quiet = RoutingRequest(model="base"), RoutingRequest(model="base")
    tasks = [asyncio.create_task(queue.wait(noisy, "noisy")), asyncio.create_task(queue.wait(quiet, "quiet"))]
    decisions = await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert all(d.endpoint is pod for d in decisions) and (quiet.priority, noisy.priority) == (1, 0)


async def test_within_a_tenant_higher_priority_goes_first_then_arrival_order():
    picker, pod = saturated_pool()
    order = await drain(FairQueue(picker), pod, [("a", 1, 0), ("a", 1, 5), ("a", 1, 1), ("a", 1, 5)])
    assert [p for _, p in order] == [5, 5, 1, 0]


async def test_an_idle_tenant_banks_no_credit():
    picker, pod = saturated_pool()
    queue = FairQueue(picker)
    await drain(queue, pod, [("a", 1, 0)] * 3)  # only a: its virtual time moves to 3
    pod.state = EngineState(waiting=5)
    order = await drain(queue, pod, [("b", 1, 0)] * 3 + [("a", 1, 0)] * 3)
    assert [t for t, _ in order] == ["b", "a", "b", "a", "b", "a"]  # b starts at a's time, not at 0


async def test_each_tenant_is_bounded_with_a_429_naming_the_bound():
    picker, _ = saturated_pool()
    queue = FairQueue(picker, max_per_tenant=2)
    held = [asyncio.create_task(queue.wait(RoutingRequest(model="base"), "a")) for _ in range(2)]
    await asyncio.sleep(0.02)
    with pytest.raises(RoutingError) as refused:
        await queue.wait(RoutingRequest(model="base"), "a")
    assert (refused.value.status, refused.value.retry_after) == (429, 1)
    assert refused.value.message == "2 requests of tenant 'a' already wait for a free pod of `base`; retry later"
    other = asyncio.create_task(queue.wait(RoutingRequest(model="base"), "b"))  # another tenant still queues
    await asyncio.sleep(0.02)
    assert queue.waiting("base") == 3
    for task in [*held, other]:
        task.cancel()
    await asyncio.gather(*held, other, return_exceptions=True)
    assert queue.waiting("base") == 0


async def test_a_request_that_waits_its_longest_is_routed_as_before():
    picker, _ = saturated_pool()
    assert await FairQueue(picker, timeout=0.1).wait(RoutingRequest(model="base"), "a") is None


def test_sheddable_requests_and_free_pools_do_not_wait():
    picker, pod = saturated_pool()
    queue = FairQueue(picker)
    assert queue.should_wait(RoutingRequest(model="base"))
    assert not queue.should_wait(RoutingRequest(model="base", priority=-1, sheddable=True))
    assert not queue.should_wait(RoutingRequest(model="other"))  # nobody serves it: the picker answers
    pod.state = EngineState(waiting=0)
    assert not queue.should_wait(RoutingRequest(model="base"))


async def test_proxy_holds_requests_for_a_saturated_pool_until_a_pod_frees(tmp_path):
    async with Engine(waiting=10) as engine:
        gateway = await start_gateway([engine], tenants_file=write_tenants(tmp_path))
        try:
            request = asyncio.create_task(post(gateway, "key-a"))
            await asyncio.sleep(0.4)
            assert not request.done() and engine.bodies == []
            assert "kubeinfer_gateway_requests_queued 1.0" in await metrics_text(gateway)
            engine.waiting = 0  # the next scrape sees a free pod
            response = await asyncio.wait_for(request, 5)
        finally:
            await gateway.stop()
    assert response.status_code == 200 and len(engine.bodies) == 1


async def test_the_router_counts_each_tenants_running_requests_until_their_responses_end(tmp_path):
    """What the fair queue's shares are measured on: a request routed straight to a free pod counts as
    running for its tenant until its response ends, and so does one that failed on the pod."""
    release = asyncio.Event()

    async def answer_when_released(engine, body, writer):
        await release.wait()
        await answer_with_usage(engine, body, writer)

    tenants = "tenants:\n  - {name: team-a, apiKeys: [key-a]}\n  - {name: team-b, apiKeys: [key-b]}\n"
    async with Engine(on_post=answer_when_released) as engine:
        gateway = await start_gateway([engine], tenants_file=write_tenants(tmp_path, tenants))
        queue = gateway.router.fair_queue
        try:
            requests = [asyncio.create_task(post(gateway, "key-a")) for _ in range(2)]
            await asyncio.sleep(0.3)
            assert queue.running("base", "team-a") == 2 and queue.running("base", "team-b") == 0
            release.set()
            assert all(r.status_code == 200 for r in await asyncio.wait_for(asyncio.gather(*requests), 5))
            assert queue.running("base", "team-a") == 0
            engine.on_post = drop_connection
            assert (await post(gateway, "key-a")).status_code >= 500
            assert queue.running("base", "team-a") == 0
        finally:
            await gateway.stop()


async def test_proxy_still_sheds_sheddable_requests_at_once(tmp_path):
    async with Engine(waiting=10) as engine:
        gateway = await start_gateway([engine], tenants_file=write_tenants(tmp_path), trust_priority_headers=True)
        try:
            response = await asyncio.wait_for(post(gateway, "key-a", headers={"x-gateway-inference-priority": "-1"}),
                                              2)
        finally:
            await gateway.stop()
    assert response.status_code == 429 and "sheddable requests are refused" in response.json()["error"]["message"]


async def test_ext_proc_holds_requests_for_a_saturated_pool_until_a_pod_frees(tmp_path):
    from test_gateway_tenants import _processor

    processor, router = _processor(tmp_path)
    router.fair_queue = FairQueue(router.picker, metrics=router.metrics)
    pod = next(iter(router.picker.pool))
    pod.state = EngineState(waiting=10)
    answer = asyncio.create_task(_run(processor, _request("key-a")))
    await asyncio.sleep(0.1)
    assert not answer.done()
    assert "kubeinfer_gateway_requests_queued 1.0" in generate_latest(router.metrics.registry).decode()
    pod.state = EngineState(waiting=0)
    replies = await asyncio.wait_for(answer, 2)
    assert not replies[-1].HasField("immediate_response")
    header = replies[-1].request_body.response.header_mutation.set_headers[0].header
    assert (header.key, header.raw_value) == ("x-gateway-destination-endpoint", b"10.0.0.1:8000")


async def test_ext_proc_refuses_beyond_the_tenant_bound(tmp_path):
    from test_gateway_tenants import _processor

    processor, router = _processor(tmp_path)
    router.fair_queue = FairQueue(router.picker, max_per_tenant=1)
    next(iter(router.picker.pool)).state = EngineState(waiting=10)
    waiting = asyncio.create_task(_run(processor, _request("key-a")))
    await asyncio.sleep(0.05)
    status, headers, body = _immediate(await _run(processor, _request("key-a")))
    assert (status, headers["retry-after"]) == (429, "1")
    assert body["error"]["message"] == "1 requests of tenant 'team-a' already wait for a free pod of `base`; retry later"
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert router.fair_queue.waiting() == 0
