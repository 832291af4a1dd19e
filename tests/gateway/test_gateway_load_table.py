"""The picker's column view of the pool (load_table.py) and its prefix index: they must follow every
change to the endpoints, and agree with the per-endpoint definitions they replace."""
from __future__ import annotations

import random

from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool, EngineState
from kubeinfer.gateway.datastore.load_table import LoadTable
from kubeinfer.gateway.scheduling.picker import Picker, PickerConfig, RoutingRequest
from kubeinfer.gateway.scheduling.prefix import PrefixIndex, chunk_hashes


def scraped(address: str, waiting=0.0, models=("base",), placed=()) -> Endpoint:
    e = Endpoint(address, placed_adapters=frozenset(placed))
    e.record_scrape(EngineState(waiting=waiting, max_loras=2), frozenset(models), frozenset({"base"}))
    return e


def table_of(*endpoints: Endpoint) -> tuple[EndpointPool, LoadTable]:
    pool = EndpointPool()
    pool.set_members(list(endpoints))
    table = LoadTable(pool)
    table.sync()
    return pool, table


def test_rows_follow_dispatches_scrapes_direct_writes_and_membership():
    a, b = scraped("a:1"), scraped("b:1", models=("base", "ad"))
    pool, table = table_of(a, b)
    sent = a.record_dispatch()
    a.record_dispatch()
    table.sync()
    assert table.queue.tolist() == [2.0, 0.0] and table.active.tolist() == [2.0, 0.0]
    a.record_finish(sent)
    b.state = EngineState(waiting=7, kv_usage=0.5)  # a plain attribute write, as tests and the simulation do
    table.sync()
    assert table.queue.tolist() == [1.0, 7.0] and table.kv_usage.tolist() == [0.0, 0.5]
    assert table.loaded.mask("ad").tolist() == [False, True]
    b.drop_model("ad")  # the pod answered 404 for it
    table.sync()
    assert not table.loaded.mask("ad").any() and not table.knows("ad")
    pool.set_members([b, scraped("c:1", placed=["ad"])])
    table.sync()
    assert [e.address for e in table.endpoints] == ["b:1", "c:1"]
    assert table.queue.tolist() == [7.0, 0.0] and table.assigned.mask("ad").tolist() == [False, True]


def test_a_cached_mask_is_never_changed_in_place():
    a = scraped("a:1")
    _, table = table_of(a)
    mask = table.loaded.mask("base")
    a.record_scrape(EngineState(), frozenset({"other"}), frozenset({"other"}))
    table.sync()
    assert mask.tolist() == [True] and table.loaded.mask("base").tolist() == [False]


def test_match_counts_agree_with_each_endpoint_walked_alone():
    """The inverted walk against the per-endpoint definition, with evictions (small capacity)."""
    rng = random.Random(3)
    systems = ["".join(rng.choice("abcdefgh") for _ in range(64 * rng.randint(2, 12))) for _ in range(6)]
    index = PrefixIndex(capacity_per_endpoint=40)
    addresses = [f"e{i}:1" for i in range(8)]
    for _ in range(300):
        prompt = rng.choice(systems) + "".join(rng.choice("xyz") for _ in range(rng.randint(0, 200)))
        hashes = chunk_hashes("m", prompt)
        counts = index.match_counts(hashes)
        for address in addresses:
            expected = round(index.match_fraction(address, hashes) * len(hashes)) if hashes else 0
            assert counts.get(address, 0) == expected
        index.remember(rng.choice(addresses), hashes)


def test_a_prompts_leading_chunks_are_evicted_last():
    index = PrefixIndex(capacity_per_endpoint=12)
    first = chunk_hashes("m", "".join(f"{i:064d}" for i in range(10)))
    index.remember("a:1", first)
    index.remember("a:1", chunk_hashes("m", "z" * 64 * 5))  # 15 chunks: the 3 oldest must go
    assert index.match_fraction("a:1", first) == 0.7  # the prompt's tail went, its head stayed


def test_independent_replicas_send_a_new_prompt_to_the_same_pod():
    """Two pickers that share nothing agree on where an unseen prefix lives (rendezvous affinity), and
    different prompts still spread over the pool."""
    def replica(seed: int) -> Picker:
        pool = EndpointPool()
        pool.set_members([scraped(f"10.0.0.{i}:8000") for i in range(10)])
        return Picker(pool, PickerConfig(), rng=random.Random(seed))

    one, two = replica(1), replica(2)
    homes = set()
    for i in range(60):
        prompt = f"system prompt number {i} " * 60
        a = one.pick(RoutingRequest("base", prompt)).endpoint
        b = two.pick(RoutingRequest("base", prompt)).endpoint
        assert a.address == b.address
        homes.add(a.address)
        for picker, chosen in ((one, a), (two, b)):  # the request ended: both replicas idle again
            chosen.record_scrape(EngineState(max_loras=2), chosen.models, chosen.base_models)
    assert len(homes) >= 8


def test_the_fair_queues_dispatch_prefers_a_pod_with_a_free_place_in_its_batch():
    full = Endpoint("full:1")
    full.record_scrape(EngineState(running=4, max_running=4), frozenset({"base"}), frozenset({"base"}))
    roomy = Endpoint("roomy:1")
    roomy.record_scrape(EngineState(waiting=2, running=3, max_running=4), frozenset({"base"}), frozenset({"base"}))
    pool = EndpointPool()
    pool.set_members([full, roomy])
    picker = Picker(pool, PickerConfig(), rng=random.Random(0))
    assert picker.pick(RoutingRequest("base")).endpoint is full  # by score: no queue there
    assert picker.pick(RoutingRequest("base"), free_slot=True).endpoint is roomy
