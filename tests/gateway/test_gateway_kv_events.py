"""The gateway's KV-event state: both wire encodings, the block index, and the subscriber following real
engines over their ZMQ sockets, checked against each engine's block manager (its `hash_to_block` is what
is cached; nobody here wrote the reference for what a request's blocks are but the engine itself)."""
from __future__ import annotations

import time

import msgpack
import msgspec
import pytest
from kv_events_helpers import LOCAL, WAIT_S

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.core import kv_events as engine_events
from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool, EngineState
from kubeinfer.gateway.datastore.kv_block_index import KVBlockIndex, chain_keys
from kubeinfer.gateway.datastore.kv_event_subscriber import EventSource, KVEventSubscriber, Stream, sources_from_pool
from kubeinfer.gateway.datastore.kv_event_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireError,
    decode_batch,
)

BS = 4
POD = "10.0.0.1:8000"


def _params(n: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# -- the wire ---------------------------------------------------------------------------------------------------
def _engine_batch() -> bytes:
    """A batch as the engine's publisher encodes it (msgspec array structs, vLLM's first encoding)."""
    batch = engine_events.KVEventBatch(ts=1.5, events=[
        engine_events.BlockStored([b"h1", b"h2"], None, list(range(8)), 4, None, "GPU", None),
        engine_events.BlockRemoved([b"h1"], "GPU"), engine_events.AllBlocksCleared()], data_parallel_rank=0)
    return msgspec.msgpack.encode(batch)


def _map_batch() -> bytes:
    """The same batch in vLLM's later encoding: maps keyed by field name, the tag under "type"."""
    return msgpack.packb({"ts": 1.5, "data_parallel_rank": 0, "events": [
        {"type": "BlockStored", "block_hashes": [b"h1", b"h2"], "parent_block_hash": None,
         "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [b"h1"], "medium": "GPU"}, {"type": "AllBlocksCleared"}]})


def test_both_wire_encodings_decode_to_the_same_events():
    arrays, maps = decode_batch(_engine_batch()), decode_batch(_map_batch())
    assert arrays == maps
    assert arrays.events == [BlockStored([b"h1", b"h2"], None, list(range(8)), 4, None, "GPU", None),
                             BlockRemoved([b"h1"], "GPU"), AllBlocksCleared()]
    assert arrays.ts == 1.5 and arrays.data_parallel_rank == 0


def test_older_and_newer_field_sets_are_tolerated():
    # vLLM before lora_name/medium: fewer trailing fields; a later one with an extra field appended
    short = msgpack.packb([0.0, [["BlockStored", [7, 8], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None]]])
    event = decode_batch(short).events[0]
    assert event.block_hashes == [7, 8] and event.medium == "GPU" and event.lora_name is None
    longer = msgpack.packb({"ts": 0, "events": [{"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU",
                                                  "extra": 1}]})
    assert decode_batch(longer).events == [BlockRemoved([7], "CPU")]


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb("text"), msgpack.packb([0, [["Bogus"]]]),
                                     msgpack.packb([0, [["BlockStored", [1]]]]), msgpack.packb({"ts": 0, "events": 3})])
def test_malformed_batches_are_wire_errors(payload):
    with pytest.raises(WireError):
        decode_batch(payload)


# -- the index --------------------------------------------------------------------------------------------------
def test_the_index_keys_blocks_by_their_tokens_whatever_the_engine_hash():
    index, tokens = KVBlockIndex(), list(range(12))
    index.apply("a", [BlockStored([b"x1", b"x2", b"x3"], None, tokens, 4)])  # our engine: bytes
    index.apply("b", [BlockStored([11, 12], None, tokens[:8], 4), BlockStored([13], 12, tokens[8:], 4)])  # ints
    keys = chain_keys(tokens, 4)
    assert index.keys_of("a") == index.keys_of("b") == set(keys)
    assert index.leading_runs(keys, ["a", "b", "c"]) == {"a": (3, 3), "b": (3, 3)}
    index.apply("b", [BlockRemoved([12])])  # the middle block: the run stops before it
    assert index.leading_runs(keys, ["b"]) == {"b": (1, 1)}
    index.apply("a", [AllBlocksCleared()])
    assert index.keys_of("a") == set() and "a" in index.pods


def test_adapters_media_and_orphans():
    index, tokens = KVBlockIndex(), list(range(8))
    index.apply("a", [BlockStored([1, 2], None, tokens, 4, lora_id=3, lora_name="sql")])
    assert index.leading_runs(chain_keys(tokens, 4), ["a"]) == {}  # the base model's keys differ
    assert index.leading_runs(chain_keys(tokens, 4, "sql"), ["a"]) == {"a": (2, 2)}
    # an offloaded copy of the first block, then the device copy of the second only: device run 0
    index.apply("b", [BlockStored([1], None, tokens[:4], 4, medium="CPU"), BlockStored([2], 1, tokens[4:], 4, medium="CPU")])
    assert index.leading_runs(chain_keys(tokens, 4), ["b"]) == {"b": (0, 2)}
    index.apply("b", [BlockRemoved([1], "CPU")])
    assert index.leading_runs(chain_keys(tokens, 4), ["b"]) == {}
    index.apply("c", [BlockStored([9], 8, tokens[:4], 4)])  # its parent was never announced: not indexable
    assert index.keys_of("c") == set() and index.pods["c"].orphans == 1


def test_sources_come_from_the_load_report_or_the_default_port():
    pool = EndpointPool()
    pool.set_members([Endpoint(f"10.0.0.{i}:8000") for i in range(1, 5)])
    states = {"10.0.0.1:8000": EngineState(load_report=True, kv_events={"endpoint": "tcp://10.0.0.1:7000",
                                                                         "replay_endpoint": "tcp://10.0.0.1:7001",
                                                                         "topic": "t"}),
              "10.0.0.2:8000": EngineState(load_report=True, kv_events=None),  # ours, events off
              "10.0.0.3:8000": EngineState()}  # Prometheus text: vLLM, which does not say
    for endpoint in pool:
        endpoint.state = states.get(endpoint.address)
    assert sources_from_pool(pool, 5557) == {"10.0.0.1:8000": EventSource("tcp://10.0.0.1:7000", "tcp://10.0.0.1:7001", "t"),
                                             "10.0.0.3:8000": EventSource("tcp://10.0.0.3:5557")}
    assert set(sources_from_pool(pool, 0)) == {"10.0.0.1:8000"}


# -- following real engines -------------------------------------------------------------------------------------
class Followed:
    """An engine with events on and the gateway's subscriber following it, driven step by step."""

    def __init__(self, model_dir, start_subscriber: bool = True, **kwargs) -> None:
        self.llm = LLM(str(model_dir), block_size=BS, kv_events_config=dict(LOCAL), **kwargs)
        publisher = self.llm.engine.kv_events.publisher
        self.source = EventSource(publisher.endpoint, publisher.replay_endpoint)
        self.index = KVBlockIndex()
        self.sub = KVEventSubscriber(self.index, lambda: {POD: self.source}, lost_after=WAIT_S)
        if start_subscriber:
            self.connect()

    def connect(self) -> None:
        """Until the subscription is live (ZMQ drops what a PUB sends before it): an empty-cache reset
        publishes AllBlocksCleared, repeated until one arrives."""
        deadline = time.time() + WAIT_S
        while POD not in self.index.pods and time.time() < deadline:
            if not self.llm.engine.block_manager.hash_to_block:
                self.llm.reset_prefix_cache()
            self.sub.step(50)
        assert POD in self.index.pods, "no KV event reached the gateway's subscriber"

    def catch_up(self, pod: str = POD, llm=None) -> None:
        """Until the publisher (of `llm`, this pod's engine by default) has sent every batch its engine queued
        (a batch's sequence number is given when it is sent) and this subscriber's stream of `pod` has them all."""
        publisher = (llm or self.llm).engine.kv_events.publisher
        deadline = time.time() + WAIT_S
        while time.time() < deadline:
            self.sub.step(20)
            stream = self.sub.streams[pod]
            if publisher._next_seq >= publisher.enqueued and stream.last_seq == publisher._next_seq - 1:
                return
        raise AssertionError("the subscriber did not catch up")

    def assert_matches_engine(self) -> None:
        """The index holds exactly the engine's cached blocks: same engine hashes, and our keys of them are
        the chained keys of the tokens each block holds (read back from the engine's blocks)."""
        bm = self.llm.engine.block_manager
        assert self.index.pods[POD].engine_hashes() == set(bm.hash_to_block)
        assert len(self.index.keys_of(POD)) == len(bm.hash_to_block)

    def close(self) -> None:
        self.sub.stop()
        self.llm.engine.kv_events.shutdown()


@pytest.fixture
def followed():
    made = []

    def make(model_dir, **kwargs):
        made.append(Followed(model_dir, **kwargs))
        return made[-1]
    yield make
    for f in made:
        f.close()


def test_a_requests_blocks_reach_the_index_under_our_keys(llama_dir, followed):
    f = followed(llama_dir, num_kv_blocks=64)
    prompt = list(range(10, 28))
    out = f.llm.generate([prompt], _params(6))[0]
    f.catch_up()
    f.assert_matches_engine()
    tokens = prompt + list(out.outputs[0].token_ids)
    full = (len(tokens) - 1) // BS  # the last token is never computed
    keys = chain_keys(tokens[:full * BS], BS)
    assert f.index.keys_of(POD) == set(keys)
    assert f.index.leading_runs(chain_keys(prompt, BS), [POD]) == {POD: (len(prompt) // BS,) * 2}


def test_evictions_under_kv_pressure_and_a_reset_leave_no_phantoms(llama_dir, followed):
    f = followed(llama_dir, num_kv_blocks=10, max_num_seqs=2)
    for i in range(6):  # distinct prompts: each evicts older blocks
        f.llm.generate([[100 + 7 * i + j for j in range(14)]], _params())
        f.catch_up()
        f.assert_matches_engine()
    f.llm.reset_prefix_cache()
    f.catch_up()
    assert f.index.keys_of(POD) == set() and not f.llm.engine.block_manager.hash_to_block


def test_an_adapter_requests_blocks_are_keyed_by_its_name(lora_base_dir, lora_adapters, followed):
    f = followed(lora_base_dir, enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_blocks=64)
    lora = lora_adapters["attn"][0]
    prompt = list(range(20, 33))
    f.llm.generate([prompt], _params(3), lora_request=lora)
    f.catch_up()
    f.assert_matches_engine()
    assert f.index.leading_runs(chain_keys(prompt, BS, lora.lora_name), [POD]) == {POD: (3, 3)}
    assert f.index.leading_runs(chain_keys(prompt, BS), [POD]) == {}


def test_a_gap_is_filled_from_the_replay_socket(llama_dir, followed, monkeypatch):
    f = followed(llama_dir, num_kv_blocks=12, max_num_seqs=2)
    lost = []
    receive = f.sub._receive

    def lossy(pod, stream, seq, payload):  # ZMQ loses messages: every second one never arrives
        if seq % 2:
            lost.append(seq)
            return
        receive(pod, stream, seq, payload)
    monkeypatch.setattr(f.sub, "_receive", lossy)
    for i in range(5):
        f.llm.generate([[50 + 9 * i + j for j in range(13)]], _params())
    publisher = f.llm.engine.kv_events.publisher
    deadline = time.time() + WAIT_S
    # every queued batch sent first (the publisher's thread may lag a fast engine: the loop below would see only
    # what was sent so far, maybe nothing odd yet), then until the last even one arrived
    while (publisher._next_seq < publisher.enqueued
           or f.sub.streams[POD].last_seq != max(s for s in range(publisher._next_seq) if s % 2 == 0)) \
            and time.time() < deadline:
        f.sub.step(20)
    assert lost and f.sub.streams[POD].stats["gaps"] >= 1 and f.sub.streams[POD].stats["replayed"] >= 1
    monkeypatch.setattr(f.sub, "_receive", receive)
    f.llm.generate([[7, 7, 7, 7, 7]], _params(1))  # one more batch, received: everything before is replayed
    f.catch_up()
    f.assert_matches_engine()


def test_a_subscriber_that_starts_late_replays_the_engines_buffer(llama_dir, followed):
    f = followed(llama_dir, start_subscriber=False, num_kv_blocks=64)
    f.llm.generate([list(range(30, 47))], _params())
    f.llm.generate([list(range(60, 77))], _params())  # served before the gateway subscribed
    publisher, deadline = f.llm.engine.kv_events.publisher, time.time() + WAIT_S
    while publisher._next_seq < publisher.enqueued and time.time() < deadline:  # sent, not only queued: a fast
        time.sleep(0.01)  # engine's publisher thread could still be sending them live when the gateway subscribes
    # Subscribed now: each new request publishes a batch; the first to arrive (ZMQ drops those sent before
    # the connection is up) is numbered after the earlier ones, which come from the replay socket.
    deadline, i = time.time() + WAIT_S, 0
    while POD not in f.index.pods and time.time() < deadline:
        f.llm.generate([[200 + i, 1, 2, 3, 4, 5]], _params(1))
        f.sub.step(50)
        i += 1
    f.catch_up()
    f.assert_matches_engine()
    assert f.sub.streams[POD].stats["replayed"] >= 2


def test_a_lost_stream_drops_the_pods_blocks_after_the_bound(llama_dir, followed):
    f = followed(llama_dir, num_kv_blocks=64)
    f.sub.lost_after = 0.2
    f.llm.generate([list(range(10, 28))], _params())
    f.catch_up()
    assert f.index.keys_of(POD)
    f.llm.engine.kv_events.publisher.shutdown()  # the engine's socket goes away
    deadline = time.time() + WAIT_S
    while POD in f.index.pods and time.time() < deadline:
        f.sub.step(50)
    assert POD not in f.index.pods and f.sub.dropped_pods == 1


def test_a_pod_that_leaves_the_pool_is_forgotten(llama_dir, followed):
    f = followed(llama_dir, num_kv_blocks=64)
    f.llm.generate([list(range(10, 28))], _params())
    f.catch_up()
    f.sub.sources = lambda: {}
    f.sub.step(0)
    assert POD not in f.index.pods and POD not in f.sub.streams


def test_a_restarted_engine_starts_its_pod_over():
    index = KVBlockIndex()
    sub = KVEventSubscriber(index, lambda: {})
    stream = Stream(EventSource("x"), None, None, last_seq=9)
    index.apply(POD, [BlockStored([1], None, [1, 2, 3, 4], 4)])
    sub._receive(POD, stream, 0, msgpack.packb([0, [["BlockStored", [5], None, [5, 6, 7, 8], 4]]]))
    assert index.keys_of(POD) == set(chain_keys([5, 6, 7, 8], 4)) and stream.stats["restarts"] == 1
    sub.stop()


def test_after_a_mixed_run_on_two_engines_the_index_is_their_caches(llama_dir, followed):
    """Two engines under KV pressure, one subscriber following both: requests that share prefixes and
    requests that evict them, interleaved, then a reset on one. No phantom block, none missing."""
    a, b = followed(llama_dir, num_kv_blocks=14, max_num_seqs=2), followed(llama_dir, num_kv_blocks=14, max_num_seqs=2)
    other = "10.0.0.2:8000"
    a.sub.stop()  # one subscriber for both pods: b's
    b.sub.sources = lambda: {POD: b.source, other: a.source}
    b.sub.lost_after = WAIT_S
    deadline = time.time() + WAIT_S
    while other not in b.index.pods and time.time() < deadline:
        a.llm.reset_prefix_cache()
        b.sub.step(50)
    seen: list = []
    apply = b.index.apply
    b.index.apply = lambda pod, events: (seen.extend(events), apply(pod, events))
    rng = __import__("random").Random(0)
    shared = [list(range(300 + 20 * g, 312 + 20 * g)) for g in range(3)]
    for i in range(12):
        engine = (a, b)[i % 2]
        prompt = shared[rng.randrange(3)] + [rng.randrange(10, 250) for _ in range(rng.randint(1, 9))]
        engine.llm.generate([prompt], _params(rng.randint(1, 5)))
    a.llm.reset_prefix_cache()
    b.catch_up()  # every batch sent and received (reading the sequence alone raced the last batch in a CI run)
    b.catch_up(other, a.llm)
    assert b.index.pods[POD].engine_hashes() == set(b.llm.engine.block_manager.hash_to_block)
    assert b.index.pods[other].engine_hashes() == set(a.llm.engine.block_manager.hash_to_block)
    assert any(isinstance(e, BlockRemoved) for e in seen)  # KV pressure evicted blocks on the way
    assert any(isinstance(e, AllBlocksCleared) for e in seen) and b.index.pods[POD].engine_hashes()


def test_the_gateway_exports_its_kv_event_counts(llama_dir, followed):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kubeinfer.gateway.handlers.metrics import GatewayMetrics
    from kubeinfer.gateway.scheduling.picker import Picker

    f = followed(llama_dir, num_kv_blocks=64)
    f.llm.generate([list(range(10, 28))], _params())
    f.catch_up()
    metrics = GatewayMetrics(Picker(EndpointPool()))
    assert "kubeinfer_gateway_kv_events" not in generate_latest(metrics.registry).decode()  # approximate: none
    metrics.kv_events = f.sub
    samples = {(s.name, s.labels.get("outcome")): s.value
               for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
               for s in family.samples}
    assert samples[("kubeinfer_gateway_kv_events_pods", None)] == 1
    assert samples[("kubeinfer_gateway_kv_events_batches_total", "applied")] == f.sub.streams[POD].stats["batches"] > 0
    assert samples[("kubeinfer_gateway_kv_events_pods_dropped_total", None)] == 0
    assert samples[("kubeinfer_gateway_kv_events_pod_faults_total", None)] == 0
