"""The endpoint picker's filters and scorers, on endpoints with known state (no network)."""
from __future__ import annotations

import random
import time

import pytest

from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool, EngineState, parse_engine_metrics
from kubeinfer.gateway.scheduling.prefix import chunk_hashes
from kubeinfer.gateway.scheduling.picker import Picker, PickerConfig, RoutingError, RoutingRequest
from kubeinfer.gateway.handlers.request_info import parse_request


def endpoint(address: str, *, waiting=0, running=0, kv=0.0, adapters=(), running_adapters=(), waiting_adapters=(),
             max_loras=4, placed=()) -> Endpoint:
    e = Endpoint(address=address, placed_adapters=frozenset(placed))
    e.record_scrape(EngineState(waiting=waiting, running=running, kv_usage=kv,
                                running_adapters=frozenset(running_adapters),
                                waiting_adapters=frozenset(waiting_adapters), max_loras=max_loras),
                    frozenset({"base", *adapters}), frozenset({"base"}))
    return e


def picker(*endpoints: Endpoint, **config) -> Picker:
    pool = EndpointPool()
    pool.set_members(list(endpoints))
    return Picker(pool, PickerConfig(**config), rng=random.Random(0))


def pick(p: Picker, model="base", prompt="", sheddable=False) -> str:
    return p.pick(RoutingRequest(model, prompt, sheddable)).endpoint.address


def test_only_ready_endpoints_serving_the_model_are_picked():
    stale = endpoint("stale:1", adapters=["ad"])
    stale.last_scrape = time.monotonic() - 60  # numbers a minute old are not trusted
    failing = endpoint("failing:1", adapters=["ad"])
    for _ in range(3):
        failing.record_failure()
    p = picker(endpoint("a:1"), endpoint("b:1", adapters=["ad"]), stale, failing)
    assert {pick(p, "ad") for _ in range(5)} == {"b:1"}
    with pytest.raises(RoutingError) as error:
        pick(p, "nope")
    assert error.value.status == 404 and "does not exist" in error.value.message
    only_stale = picker(endpoint("a:1"), stale)
    with pytest.raises(RoutingError) as error:
        pick(only_stale, "ad")
    assert error.value.status == 503  # known model, but nobody ready serves it now
    with pytest.raises(RoutingError) as error:
        pick(picker(stale), "base")
    assert error.value.status == 503


def test_placed_adapter_counts_as_served_while_it_loads():
    p = picker(endpoint("a:1"), endpoint("b:1", placed=["new"]))
    assert pick(p, "new") == "b:1"


def test_queue_then_kv_cache():
    assert pick(picker(endpoint("a:1", waiting=3), endpoint("b:1", waiting=1), endpoint("c:1", waiting=2))) == "b:1"
    assert pick(picker(endpoint("a:1", kv=0.5), endpoint("b:1", kv=0.1), endpoint("c:1", kv=0.3))) == "b:1"


def test_running_load_counts_when_no_engine_has_a_queue():
    """Engines that admit everything into their batch show no waiting queue: running requests decide."""
    assert pick(picker(endpoint("a:1", running=6), endpoint("b:1", running=1), endpoint("c:1", running=3))) == "b:1"


def test_a_burst_spreads_over_idle_endpoints():
    """Our own dispatches count as queue until the next scrape, so a burst does not pile onto one pod."""
    p = picker(*(endpoint(f"e{i}:1") for i in range(3)))
    counts = {}
    for _ in range(12):
        address = pick(p)
        counts[address] = counts.get(address, 0) + 1
    assert sorted(counts.values()) == [4, 4, 4]


def test_a_scrape_that_started_before_a_dispatch_does_not_forget_it():
    """The scrape reads the pod before our request reaches it: the request stays counted after it lands."""
    e = endpoint("a:1", running=2)
    before = time.monotonic()
    sent = e.record_dispatch(now=before + 1.0)  # sent while a scrape that began at `before` was in flight
    e.record_scrape(EngineState(running=2), e.models, e.base_models, started=before)
    assert e.num_unseen == 1 and e.queue == 1 and e.active == 3
    e.record_scrape(EngineState(running=3), e.models, e.base_models, started=sent + 0.5)  # this one saw it
    assert e.num_unseen == 0 and e.active == 3


def test_finished_requests_stop_counting_before_the_next_scrape():
    e = endpoint("a:1", running=0)
    unseen = e.record_dispatch()
    e.record_finish(unseen)  # ended before any scrape saw it
    assert e.num_unseen == 0 and e.active == 0 and e.finished_since_scrape == 0
    seen = e.record_dispatch()
    e.record_scrape(EngineState(running=4), e.models, e.base_models, started=seen + 1e-6)
    e.record_finish(seen)  # the scrape counted it among the 4 running; it is over now
    assert e.active == 3
    for _ in range(6):  # more ends than the scrape showed (some were waiting): never below zero
        e.record_finish(seen)
    assert e.active == 0
    e.record_scrape(EngineState(running=1), e.models, e.base_models)
    assert e.finished_since_scrape == 0 and e.active == 1


def test_finished_requests_free_their_endpoint_for_the_next_pick():
    p = picker(endpoint("a:1"), endpoint("b:1"))
    first = p.pick(RoutingRequest("base"))
    first.endpoint.record_finish(first.sent)
    assert p.pick(RoutingRequest("base")).endpoint.num_unseen == 1  # both idle again: either may win
    assert sorted(e.num_unseen for e in p.pool) == [0, 1]


def test_lora_affinity_order():
    def best(*endpoints):
        return pick(picker(*endpoints, weights={"lora": 1.0}), "ad")
    loaded = dict(adapters=["ad"])
    assert best(endpoint("waiting:1", **loaded, running_adapters=["x"], max_loras=1, waiting_adapters=["ad"]),
                endpoint("active:1", **loaded, running_adapters=["ad"]),
                endpoint("free:1", **loaded)) == "active:1"
    assert best(endpoint("waiting:1", **loaded, running_adapters=["x"], max_loras=1, waiting_adapters=["ad"]),
                endpoint("free:1", **loaded)) == "free:1"
    assert best(endpoint("full:1", **loaded, running_adapters=["x"], max_loras=1),
                endpoint("waiting:1", **loaded, running_adapters=["x"], max_loras=1, waiting_adapters=["ad"])) == "waiting:1"


def test_prefix_affinity_brings_a_long_prompt_back():
    p = picker(*(endpoint(f"e{i}:1") for i in range(4)))
    system = "You are a helpful assistant who answers in detail. " * 20
    first = pick(p, prompt=system + "question one")
    # Later requests with the same long prefix return to it, despite the queue it now has.
    assert [pick(p, prompt=system + f"question {i}") for i in range(3)] == [first] * 3
    # The prefix belongs to the model: the same text under an adapter shares no KV blocks.
    assert p.prefix_index.match_fraction(first, chunk_hashes("base", system)) == 1.0
    assert p.prefix_index.match_fraction(first, chunk_hashes("ad", system)) == 0.0


def test_saturation_sheds_sheddable_requests_only():
    p = picker(endpoint("a:1", waiting=9), endpoint("b:1", kv=0.95), queue_threshold=5, kv_threshold=0.8)
    with pytest.raises(RoutingError) as error:
        pick(p, sheddable=True)
    assert error.value.status == 429
    assert pick(p) in {"a:1", "b:1"}  # critical requests still go somewhere
    # An unsaturated endpoint takes sheddable work and is preferred for all.
    p = picker(endpoint("a:1", waiting=9), endpoint("b:1", waiting=1, kv=0.7), queue_threshold=5, kv_threshold=0.8)
    assert pick(p, sheddable=True) == "b:1" and pick(p) == "b:1"


def test_decision_lists_fallbacks():
    p = picker(endpoint("a:1", waiting=0), endpoint("b:1", waiting=1), endpoint("c:1", waiting=2), fallbacks=2)
    decision = p.pick(RoutingRequest("base"))
    assert decision.destination == "a:1,b:1,c:1" and decision.scores["total"] > 0


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="unknown scorer"):
        PickerConfig(weights={"queue": 1, "vibes": 2})


def test_parse_request():
    """Priority and objective headers as a trusted hop in front sets them (--trust-priority-headers)."""
    from functools import partial
    trusted = partial(parse_request, trust_headers=True)
    request = parse_request(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', {})
    assert (request.model, request.prompt, request.sheddable) == ("m", "<user>hi", False)
    assert trusted(b'{"model": "m", "prompt": "x"}', {"x-gateway-inference-priority": "-1"}).sheddable
    assert parse_request(b'{"model": "m", "prompt": "x"}', {}, {"m": -2}).sheddable
    assert not trusted(b'{"model": "m", "prompt": "x"}', {"x-gateway-inference-priority": "3"}, {"m": -2}).sheddable
    assert parse_request(b"", {}).model == ""  # GET: any endpoint
    # The Inference Extension's InferenceObjective, named by header, outranks the model's priority.
    body, objectives = b'{"model": "m", "prompt": "x"}', {"batch": -5, "chat": 10}
    assert trusted(body, {"x-gateway-inference-objective": "batch"}, {}, objectives).sheddable
    assert not trusted(body, {"x-gateway-inference-objective": "chat"}, {"m": -2}, objectives).sheddable
    assert not trusted(body, {"x-gateway-inference-objective": "unknown"}, {"m": -2}, objectives).sheddable
    assert trusted(body, {"x-gateway-inference-objective": "chat", "x-gateway-inference-priority": "-1"},
                   {}, objectives).sheddable  # an explicit priority header wins over all
    for body, message in [(b"{nope", "not valid JSON"), (b"[1]", "JSON object"), (b'{"prompt": "x"}', "model")]:
        with pytest.raises(RoutingError, match=message) as error:
            parse_request(body, {})
        assert error.value.status == 400
    with pytest.raises(RoutingError, match="integer"):
        trusted(b'{"model": "m"}', {"x-gateway-inference-priority": "high"})


def test_parse_engine_metrics():
    text = "\n".join([
        '# TYPE vllm:num_requests_waiting gauge', 'vllm:num_requests_waiting{model_name="m"} 3.0',
        '# TYPE vllm:num_requests_running gauge', 'vllm:num_requests_running{model_name="m"} 2.0',
        '# TYPE vllm:kv_cache_usage_perc gauge', 'vllm:kv_cache_usage_perc{model_name="m"} 0.25',
        '# TYPE vllm:lora_requests_info gauge',
        'vllm:lora_requests_info{max_lora="2",model_name="m",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9',
        ""])
    state = parse_engine_metrics(text)
    assert (state.waiting, state.running, state.kv_usage, state.max_loras) == (3, 2, 0.25, 2)
    assert state.running_adapters == {"a", "b"} and state.waiting_adapters == frozenset()


def test_the_gateway_priority_reaches_the_engine_inverted():
    """The Inference Extension's priority (higher first) becomes the engine's (vLLM's: lower first) in one
    place; a body that needs no change is forwarded byte for byte."""
    import json

    from kubeinfer.gateway.handlers.engine_body import engine_body
    from kubeinfer.gateway.handlers.request_info import engine_priority

    assert engine_priority(10) == -10 and engine_priority(-1) == 1
    raw = b'{"model": "m",  "prompt": "hi", "priority": 0}'
    assert engine_body(raw, priority=0) is raw
    assert json.loads(engine_body(raw, priority=-10)) == {"model": "m", "prompt": "hi", "priority": -10}
    request = parse_request(b'{"model": "m"}', {"x-gateway-inference-priority": "7"}, trust_headers=True)
    assert request.priority == 7 and not request.sheddable


def test_the_priority_is_written_for_the_engine_only_when_forwarded():
    import json

    from kubeinfer.gateway.handlers.routing import Router

    raw = b'{"model": "m", "prompt": "hi"}'
    request = parse_request(raw, {"x-gateway-inference-priority": "4"}, trust_headers=True)
    assert Router(Picker(EndpointPool())).body_for_engine(raw, request) is raw  # engines may run fcfs
    forwarded = Router(Picker(EndpointPool()), forward_priority=True).body_for_engine(raw, request)
    assert json.loads(forwarded)["priority"] == -4
