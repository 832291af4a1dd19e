"""Issue #44, finding 3: one engine, or whatever answers its `/load`, must not break the gateway's KV-event
subscriber for the other pods. Two publishers on loopback written by the test (kv_events_helpers.FakeEngine):
`good` behaves, `bad` sends what the case says; after each case the bad pod is forgotten (scored approximately)
and the good one still followed, by the same subscriber."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import msgpack
import pytest
import zmq
from kv_events_helpers import WAIT_S, FakeEngine, cleared_batch, stored_batch

from kubeinfer.gateway.datastore import kv_event_subscriber
from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool, EngineState
from kubeinfer.gateway.datastore.kv_block_index import KVBlockIndex, chain_keys
from kubeinfer.gateway.datastore.kv_event_fetch import MAX_MESSAGE_BYTES
from kubeinfer.gateway.datastore.kv_event_subscriber import MAX_REPLAY, EventSource, KVEventSubscriber
from kubeinfer.gateway.datastore.kv_event_wire import MAX_BLOCK_SIZE
from kubeinfer.gateway.scheduling.precise_prefix import PrecisePrefixScorer

GOOD, BAD = "127.0.0.1:8001", "127.0.0.1:8002"
TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]


class Pods:
    """A good and a bad publisher followed by one subscriber, driven step by step (or by its thread)."""

    def __init__(self, replay: bool = False, index: KVBlockIndex | None = None) -> None:
        self.engines = {GOOD: FakeEngine(), BAD: FakeEngine(replay=replay)}
        self.next_seq = {GOOD: 0, BAD: 0}
        self.index = index or KVBlockIndex()
        sources = {pod: EventSource(e.endpoint, e.replay_endpoint) for pod, e in self.engines.items()}
        self.sub = KVEventSubscriber(self.index, lambda: sources, lost_after=WAIT_S)
        self.threaded = False

    def connect(self) -> None:
        """Seq 0, repeated, until both pods are known (ZMQ drops what a PUB sends before the connection)."""
        deadline = time.time() + WAIT_S
        while not {GOOD, BAD} <= set(self.index.pods) and time.time() < deadline:
            for pod, engine in self.engines.items():
                if pod not in self.index.pods:
                    engine.send(0, cleared_batch())
            self.wait(0.02)
        assert {GOOD, BAD} <= set(self.index.pods), "the subscriber did not connect"
        self.next_seq = {GOOD: 1, BAD: 1}

    def wait(self, seconds: float) -> None:
        if self.threaded:
            time.sleep(seconds)
        else:
            self.sub.step(int(seconds * 1000))

    def stream(self, pod: str):
        return self.sub.streams[pod]

    def send(self, pod: str, payload: bytes, seq: int | None = None) -> int:
        seq = self.next_seq[pod] if seq is None else seq
        self.engines[pod].send(seq, payload)
        self.next_seq[pod] = seq + 1
        return seq

    def until(self, done, wait_s: float = WAIT_S) -> bool:
        deadline = time.time() + wait_s
        while time.time() < deadline:
            if done():
                return True
            self.wait(0.02)
        return False

    def deliver(self, pod: str, payload: bytes) -> None:
        """Send one batch and wait until the pod's stream applied it or set the pod aside."""
        faults = self.stream(pod).stats["faults"]
        seq = self.send(pod, payload)
        assert self.until(lambda: self.stream(pod).last_seq == seq or self.stream(pod).stats["faults"] > faults)

    def assert_good_still_followed(self) -> None:
        hashes = [b"g%d" % self.next_seq[GOOD]]
        self.deliver(GOOD, stored_batch(hashes, TOKENS[:4]))
        assert hashes[0] in self.index.pods[GOOD].engine_hashes()

    def close(self) -> None:
        self.sub.stop()
        for engine in self.engines.values():
            engine.close()


@pytest.fixture
def pods():
    made = []

    def make(**kwargs) -> Pods:
        made.append(Pods(**kwargs))
        made[-1].connect()
        return made[-1]
    yield make
    for p in made:
        p.close()


def _stored(**fields) -> list:
    event = {"block_hashes": [b"b1"], "parent_block_hash": None, "token_ids": TOKENS[:4], "block_size": 4,
             "lora_id": None, "medium": "GPU", "lora_name": None, **fields}
    return ["BlockStored", *event.values()]


def _batch(*events, ts=0.0, rank=0) -> bytes:
    return msgpack.packb([ts, list(events), rank])


MALFORMED = {
    "not msgpack": b"\xc1\xc1",
    "ts a string": _batch(_stored(), ts="now"),
    "events a number": msgpack.packb([0.0, 3, 0]),
    "rank a string": _batch(_stored(), rank="zero"),
    "unknown event type": _batch(["BlockEvicted", [b"b1"]]),
    "event type a number": _batch([7, [b"b1"]]),
    "block_hashes a string": _batch(_stored(block_hashes="b1")),
    "a hash a float": _batch(_stored(block_hashes=[1.5])),
    "a hash of 65 bytes": _batch(_stored(block_hashes=[b"x" * 65])),
    "an empty hash": _batch(_stored(block_hashes=[b""])),
    "parent a list": _batch(_stored(parent_block_hash=[1, 2])),
    "token_ids a string": _batch(_stored(token_ids="abcd")),
    "a token id negative": _batch(_stored(token_ids=[1, 2, 3, -4])),
    "a token id past 63 bits": _batch(_stored(token_ids=[1, 2, 3, 1 << 63])),
    "too few token ids": _batch(_stored(token_ids=[1, 2, 3])),
    "block_size 0": _batch(_stored(block_size=0, token_ids=[])),
    "block_size negative": _batch(_stored(block_size=-4)),
    "block_size a string": _batch(_stored(block_size="4")),
    "block_size true": _batch(_stored(block_size=True, token_ids=[1])),
    "block_size huge": _batch(_stored(block_size=MAX_BLOCK_SIZE + 1)),
    "lora_id a string": _batch(_stored(lora_id="sql")),
    "lora_name a list": _batch(_stored(lora_name=["sql"])),
    "medium a number": _batch(_stored(medium=3)),
    "medium too long": _batch(_stored(medium="G" * 300)),
    "removed hashes a map": _batch(["BlockRemoved", {"a": 1}, "GPU"]),
    "block size changes": _batch(_stored(block_hashes=[b"b9"], block_size=2, token_ids=[1, 2])),
    "nine media": _batch(*[_stored(block_hashes=[b"m%d" % i], medium=f"T{i}") for i in range(9)]),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_each_malformed_field_sets_only_its_pod_aside(pods, case):
    p = pods()
    p.deliver(BAD, stored_batch([b"b0"], TOKENS[:4]))  # the pod is followed and holds a block
    assert p.index.keys_of(BAD)
    p.deliver(BAD, MALFORMED[case])
    assert BAD not in p.index.pods and p.stream(BAD).stats["faults"] == 1  # forgotten: scored approximately
    p.assert_good_still_followed()


@pytest.mark.parametrize("frames", [[b"", b"\x00" * 8], [b"", b"\x00" * 3, cleared_batch()]])
def test_a_message_out_of_shape_sets_only_its_pod_aside(pods, frames):
    p = pods()
    p.engines[BAD].pub.send_multipart(frames)
    assert p.until(lambda: p.stream(BAD).stats["faults"] == 1)
    assert BAD not in p.index.pods
    p.assert_good_still_followed()


def test_a_set_aside_pod_starts_over_after_its_pause(pods):
    p = pods()
    p.sub.fault_pause = 0.2
    p.deliver(BAD, MALFORMED["token_ids a string"])
    p.send(BAD, stored_batch([b"ignored"], TOKENS[:4]))  # within the pause: ignored
    assert p.until(lambda: p.stream(BAD).stats["ignored"] >= 1)
    time.sleep(0.25)
    p.deliver(BAD, stored_batch([b"again"], TOKENS[:4]))
    assert p.index.pods[BAD].engine_hashes() == {b"again"}


def test_the_subscriber_thread_outlives_a_mistyped_event(pods):
    """The issue's first case: `index.apply` outside the try killed the thread, and every pod's stale blocks
    stayed forever."""
    p = pods()
    p.threaded = True
    p.sub.start()
    p.deliver(BAD, MALFORMED["token_ids a string"])
    assert p.sub._thread.is_alive() and BAD not in p.index.pods
    p.assert_good_still_followed()
    assert p.sub.totals()["faults"] == 1  # exported as kubeinfer_gateway_kv_events_pod_faults_total


def test_a_block_size_of_zero_never_reaches_a_pick(pods):
    """The issue: block size 0 became the fleet's size and every precise pick raised (a 500 for every model)."""
    p = pods()
    p.deliver(BAD, MALFORMED["block_size 0"])  # first: before the fix it set the size requests are keyed by
    p.deliver(GOOD, stored_batch([b"g1"], TOKENS[:4]))
    scorer = PrecisePrefixScorer(p.index, tokenizers=None)
    request = SimpleNamespace(token_ids=list(TOKENS), body=None, model="m")
    assert scorer.keys(request, None) == chain_keys(TOKENS, 4)
    assert scorer.tracks(GOOD) and not scorer.tracks(BAD)


def test_requests_are_keyed_by_the_block_size_most_pods_report():
    index = KVBlockIndex()
    index.apply("a", [_event(16)])
    index.apply("odd", [_event(1)])  # first with its size: it must not decide for the others
    index.apply("b", [_event(16)])
    assert index.block_size() == 16
    scorer = PrecisePrefixScorer(index, tokenizers=None)
    assert scorer.keys(SimpleNamespace(token_ids=list(range(32)), body=None, model="m"), None)
    assert scorer.tracks("a") and scorer.tracks("b") and not scorer.tracks("odd")
    index.drop("a")
    index.drop("b")
    assert index.block_size() == 1


def _event(size: int):
    from kubeinfer.gateway.datastore.kv_event_wire import BlockStored
    return BlockStored([b"h%d" % size], None, list(range(size)), size)


def test_a_failing_index_scores_approximately_not_with_an_error():
    index = KVBlockIndex()
    index.apply("a", [_event(4)])
    scorer = PrecisePrefixScorer(index, tokenizers=None)
    keys = scorer.keys(SimpleNamespace(token_ids=list(range(8)), body=None, model="m"), None)

    def broken(*args):
        raise RuntimeError("a bug")
    index.leading_runs = broken
    assert scorer.matched(keys, ["a"]) == {}


def test_a_huge_sequence_number_asks_for_a_bounded_replay(pods):
    """The issue: seq 2^63-1 asked for a replay of [0, 2^63)."""
    p = pods(replay=True)
    huge = (1 << 63) - 1
    p.send(BAD, stored_batch([b"late"], TOKENS[:4]), seq=huge)
    client = None
    deadline = time.time() + WAIT_S
    while client is None and time.time() < deadline:
        p.wait(0.02)
        client = p.engines[BAD].request()
    assert p.engines[BAD].requests == [huge - MAX_REPLAY]  # a jump: the pod starts over from what a replay can give
    p.engines[BAD].answer(client, -1)
    assert p.until(lambda: p.stream(BAD).last_seq == huge)
    stats = p.stream(BAD).stats
    assert stats["jumps"] == 1 and stats["missed"] == MAX_REPLAY and p.index.pods[BAD].engine_hashes() == {b"late"}
    p.assert_good_still_followed()


def test_a_silent_replay_server_holds_up_no_other_pod(pods, monkeypatch):
    monkeypatch.setattr(kv_event_subscriber, "FETCH_DEADLINE_S", 1.5)
    p = pods(replay=True)
    p.send(BAD, cleared_batch(), seq=5)  # a gap: a replay is asked for, and never answered
    assert p.until(lambda: p.engines[BAD].request() is not None)
    started = time.time()
    p.assert_good_still_followed()  # before the fix the thread sat in the replay for 2 s per gap
    assert time.time() - started < 1.0 and p.stream(BAD).fetch is not None  # the replay still waits
    assert p.until(lambda: p.stream(BAD).last_seq == 5)  # the deadline ended the replay; the batch applied
    assert p.stream(BAD).stats["missed"] == 4 and p.stream(BAD).fetch is None


def test_an_endless_replay_is_cut_at_what_was_asked(pods):
    """The issue: a replay server that never sends the end marker held the thread while frames piled up."""
    p = pods(replay=True)
    p.send(BAD, cleared_batch(), seq=4)  # asks for [1, 4)
    client = None
    while client is None:
        p.wait(0.02)
        client = p.engines[BAD].request()
    stop = threading.Event()

    def flood():  # ascending frames without end, from another thread, as fast as ZMQ takes them
        seq = 1
        while not stop.is_set() and seq < 200_000:
            p.engines[BAD].answer(client, seq, cleared_batch())
            seq += 1
    flooder = threading.Thread(target=flood)
    flooder.start()
    try:
        assert p.until(lambda: p.stream(BAD).last_seq == 4, wait_s=3.0)
    finally:
        stop.set()
        flooder.join()
    stats = p.stream(BAD).stats
    assert stats["replayed"] == 3 and stats["faults"] == 0 and p.stream(BAD).fetch is None
    p.assert_good_still_followed()


def test_a_replay_out_of_order_sets_only_its_pod_aside(pods):
    p = pods(replay=True)
    p.send(BAD, cleared_batch(), seq=9)
    client = None
    while client is None:
        p.wait(0.02)
        client = p.engines[BAD].request()
    for _ in range(3):  # the same sequence number again and again
        p.engines[BAD].answer(client, 2, cleared_batch())
    assert p.until(lambda: p.stream(BAD).stats["faults"] == 1)
    assert BAD not in p.index.pods and p.stream(BAD).fetch is None
    p.assert_good_still_followed()


def test_an_oversize_message_is_never_read(pods):
    p = pods()
    p.sub.lost_after = 0.3
    stream = p.stream(BAD)
    assert stream.sub.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES
    hashes = [(1 << 40) + i for i in range(MAX_MESSAGE_BYTES // 9 + 10)]  # 9 bytes each in msgpack
    oversize = _batch(["BlockRemoved", hashes, "GPU"])
    assert len(oversize) > MAX_MESSAGE_BYTES
    batches = stream.stats["batches"]
    p.send(BAD, oversize)
    assert p.until(lambda: p.sub.dropped_pods == 1)  # ZMQ dropped the connection instead of reading it...
    assert stream.stats["batches"] == batches and BAD not in p.index.pods  # ...and the pod was forgotten
    p.assert_good_still_followed()
    # ZMQ does not reconnect after a protocol error: the lost pod got a new socket and is followed again
    assert p.until(lambda: (p.send(BAD, stored_batch([b"back"], TOKENS[:4])), p.wait(0.05))
                   and BAD in p.index.pods and b"back" in p.index.pods[BAD].engine_hashes())


def test_a_pods_index_entries_are_capped(pods):
    """The issue: one 0.37 MB batch made 100,000 index entries."""
    p = pods(index=KVBlockIndex(max_blocks=100))
    p.deliver(BAD, stored_batch([b"%d" % i for i in range(1000)], [7] * 1000, block_size=1))
    state = p.index.pods[BAD]
    assert len(state.to_key) == 100 and state.capped == 900  # the rest not indexed: missed, never invented
    p.assert_good_still_followed()


BAD_REPORTS = {
    "topic a number": {"endpoint": "tcp://10.0.0.2:5557", "topic": 5},
    "topic too long": {"endpoint": "tcp://10.0.0.2:5557", "topic": "t" * 300},
    "endpoint a list": {"endpoint": ["tcp://10.0.0.2:5557"]},
    "endpoint on another host": {"endpoint": "tcp://10.0.0.9:5557"},
    "endpoint over ipc": {"endpoint": "ipc:///var/run/secrets/socket"},
    "endpoint without a port": {"endpoint": "tcp://10.0.0.2"},
    "port out of range": {"endpoint": "tcp://10.0.0.2:70000"},
    "replay on another host": {"endpoint": "tcp://10.0.0.2:5557", "replay_endpoint": "tcp://10.0.0.9:5558"},
    "replay a number": {"endpoint": "tcp://10.0.0.2:5557", "replay_endpoint": 5558},
    "unknown auth": {"endpoint": "tcp://10.0.0.2:5557", "auth": "kerberos"},
}


def _pool(reports: dict[str, dict]) -> EndpointPool:
    pool = EndpointPool()
    pool.set_members([Endpoint(address) for address in reports])
    for endpoint in pool:
        endpoint.state = EngineState(load_report=True, kv_events=reports[endpoint.address])
    return pool


@pytest.mark.parametrize("case", list(BAD_REPORTS))
def test_load_reports_are_checked_before_any_socket(case):
    good = {"endpoint": "tcp://10.0.0.1:5557", "replay_endpoint": "tcp://10.0.0.1:5558", "topic": "kv",
            "auth": "curve"}
    pool = _pool({"10.0.0.1:8000": good, "10.0.0.2:8000": BAD_REPORTS[case]})
    assert kv_event_subscriber.sources_from_pool(pool) == {
        "10.0.0.1:8000": EventSource("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "kv", "curve")}


def test_a_non_string_topic_from_load_does_not_stop_the_other_pods(pods):
    """The issue: a topic of 5 from /load raised in setsockopt_string and ended the subscriber thread."""
    p = pods()
    sources = {GOOD: EventSource(p.engines[GOOD].endpoint), BAD: EventSource(p.engines[BAD].endpoint, topic=5)}
    p.sub.sources = lambda: sources  # as a report would give, were it not checked
    p.sub.step(0)
    assert BAD in p.sub.unfollowed and BAD not in p.sub.streams and BAD not in p.index.pods
    p.assert_good_still_followed()
