"""A subscriber to the engine's KV events, decoding with plain msgpack (not the msgspec structs that encode
them), so the tests check the wire format vLLM's subscribers read, not our own round trip."""
from __future__ import annotations

import time

import msgpack
import zmq

LOCAL = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
         "replay_endpoint": "tcp://127.0.0.1:*"}
WAIT_S = 10.0  # a bound, not a timing: every wait below ends as soon as its condition holds


def decode(payload: bytes) -> dict:
    """An EventBatch as vLLM's array encoding lays it out: [ts, events, data_parallel_rank]; each event an array
    whose first item is its tag."""
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and 2 <= len(batch) <= 3, batch
    ts, events, *rank = batch
    return {"ts": ts, "rank": rank[0] if rank else None, "events": [_event(e) for e in events]}


def _event(event: list) -> dict:
    tag, *values = event
    names = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                             "lora_name"],
             "BlockRemoved": ["block_hashes", "medium"], "AllBlocksCleared": []}[tag]
    assert len(values) == len(names), event
    return {"type": tag, **dict(zip(names, values))}


class Subscriber:
    def __init__(self, endpoint: str, topic: str = "") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.messages: list[tuple[bytes, int, bytes]] = []  # (topic, seq, payload)

    def sync(self, llm) -> None:
        """Wait until the subscription is live (ZMQ drops what a PUB sends before it is): reset the empty cache,
        which publishes AllBlocksCleared, until one arrives. Then forget what was received."""
        deadline = time.time() + WAIT_S
        while time.time() < deadline:
            llm.reset_prefix_cache()
            if self.sub.poll(100):
                self.drain(llm.engine.kv_events.publisher)
                self.messages.clear()
                return
        raise AssertionError("no KV event reached the subscriber")

    def receive_until(self, done, wait_s: float = WAIT_S) -> None:
        deadline = time.time() + wait_s
        while not done() and time.time() < deadline:
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                assert len(seq) == 8
                self.messages.append((topic, int.from_bytes(seq, "big"), payload))

    def drain(self, publisher) -> None:
        """Everything the publisher has sent so far."""
        deadline = time.time() + WAIT_S
        while publisher._next_seq < publisher.enqueued and time.time() < deadline:
            time.sleep(0.01)
        last = publisher._next_seq - 1
        self.receive_until(lambda: bool(self.messages) and self.messages[-1][1] >= last)

    def events(self) -> list[dict]:
        return [event for _, _, payload in self.messages for event in decode(payload)["events"]]

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


def replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol from a DEALER: [b"", start] -> [b"", seq, payload]... then [b"", -1, b""]."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert sock.poll(int(WAIT_S * 1000)), "no replay answer"
            _, seq, payload = sock.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                return out
            out.append((seq, payload))
    finally:
        sock.close(0)
        ctx.term()


def cached_index(events: list[dict]) -> set[bytes]:
    """The set of block hashes a subscriber believes cached after these events."""
    held: set[bytes] = set()
    for event in events:
        if event["type"] == "BlockStored":
            held.update(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            held.difference_update(event["block_hashes"])
        else:
            held.clear()
    return held


class FakeEngine:
    """A KV-event publisher on loopback that sends whatever a test writes, for the gateway's subscriber: a PUB
    socket and, with `replay`, a ROUTER whose answers the test writes as well (`answer`)."""

    def __init__(self, replay: bool = False) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.router = self.replay_endpoint = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.requests: list[int] = []  # the start of each replay request received

    def send(self, seq: int, payload: bytes, topic: bytes = b"") -> None:
        self.pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])

    def request(self, wait_ms: int = 0) -> bytes | None:
        """The client of the next replay request (its start recorded), or None."""
        if not self.router.poll(wait_ms):
            return None
        client, _, start = self.router.recv_multipart()
        self.requests.append(int.from_bytes(start, "big"))
        return client

    def answer(self, client: bytes, seq: int, payload: bytes = b"") -> None:
        self.router.send_multipart([client, b"", seq.to_bytes(8, "big", signed=True), payload])

    def close(self) -> None:
        for sock in (self.pub, self.router):
            if sock is not None:
                sock.close(0)
        self.ctx.term()


def stored_batch(block_hashes: list, tokens: list[int], block_size: int = 4, parent=None) -> bytes:
    """A valid EventBatch (vLLM's array encoding) of one BlockStored."""
    return msgpack.packb([0.0, [["BlockStored", block_hashes, parent, tokens, block_size, None, "GPU", None]], 0])


def cleared_batch() -> bytes:
    return msgpack.packb([0.0, [["AllBlocksCleared"]], 0])
