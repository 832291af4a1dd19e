"""`--kv-events-config`: vLLM's KV-events settings, and the ZMQ publisher that sends the events.

Wire protocol (vLLM's, so llm-d's indexer and our gateway subscribe to us as to vLLM):
- PUB socket at `endpoint`: multipart `[topic, 8-byte big-endian sequence number, msgpack EventBatch]`.
  A wildcard address (`tcp://*:5557`, `ipc://`, `inproc://`) is bound, any other is connected to.
- ROUTER socket at `replay_endpoint` (optional, always bound): a request `[b"", 8-byte start sequence]` (a
  DEALER's, or a REQ's) is answered with `[b"", seq, payload]` for every buffered batch from `start` on, then
  `[b"", seq -1, b""]`. The last `buffer_steps` batches are kept; clients and what they hold unread are
  bounded (kv_event_replay.py).

With an API key (`curve`, derived from `--api-key`: kubeinfer/common/kv_events_curve.py) every socket the engine
binds is a CURVE server that admits only the gateway's derived key, and `/load` says `"auth": "curve"`; a PUB
that connects goes, unauthenticated, to the address its operator named. Without a key, as vLLM.

The step loop only puts a batch on a bounded queue (`put_nowait`); one thread encodes, sends and answers
replays. A full queue or a socket that would block drops the batch and counts it (`dropped`,
`kubeinfer:kv_events_dropped_total`): a slow or absent subscriber never stalls a step. A dropped batch
still takes its sequence number, so subscribers see the gap; it is not in the replay buffer.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections import deque
from dataclasses import dataclass, fields

import msgspec
import zmq

from kubeinfer.common.kv_events_curve import AUTH_CURVE, CurveKeys, ZapGate

from ..config import json_object_flag
from .kv_event_replay import ReplayServer
from .kv_events import EventBatch, KVEventRecorder

logger = logging.getLogger(__name__)

PUBLISHERS = ("null", "zmq")
SUBSCRIPTION_BYTES = 4096  # what a subscriber sends a PUB is its topic filter; a longer one is a disconnect


@dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig keys and defaults."""
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, value: str | dict | None) -> KVEventsConfig | None:
        """The config from a JSON string or dict; None when events are off. ValueError naming what is wrong."""
        value = json_object_flag(value, "--kv-events-config")
        if value is None:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown key(s) {unknown}; known: {sorted(known)}")
        config = cls(**value)
        # vLLM: asking for events with no publisher named means the ZMQ one
        if config.enable_kv_cache_events and "publisher" not in value:
            config.publisher = "zmq"
        if config.publisher not in PUBLISHERS:
            raise ValueError(f"--kv-events-config: unknown publisher {config.publisher!r}; known: {list(PUBLISHERS)}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
                raise ValueError(f"--kv-events-config: {name} must be an integer >= 1")
        if not isinstance(config.topic, str) or not isinstance(config.endpoint, str):
            raise ValueError("--kv-events-config: endpoint and topic must be strings")
        return config if config.enable_kv_cache_events and config.publisher == "zmq" else None


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def advertised(endpoint: str) -> str:
    """The address a subscriber elsewhere can use: a wildcard or any-address host becomes this pod's IP."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::", ""):
        host = os.environ.get("POD_IP") or _own_ip()
    return f"tcp://{host}:{port}"


def _own_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0, curve: CurveKeys | None = None) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.dropped = 0  # batches dropped: queue full or socket would block
        self.published = 0
        self.enqueued = 0  # batches accepted from the step loop; each gets a sequence number when sent
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._next_seq = 0
        self._ctx = zmq.Context()
        self.curve = curve
        # Sockets are made here so that a busy port is a start-up error; from now on only the thread uses them.
        self.zap = ZapGate(self._ctx, curve) if curve is not None else None  # before any CURVE socket binds
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.MAXMSGSIZE, SUBSCRIPTION_BYTES)
        self.replay: ReplayServer | None = None
        try:
            if _binds(config.endpoint):
                if curve is not None:
                    curve.serve(self._pub)
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint:
                self.replay = ReplayServer(self._ctx, config.replay_endpoint, self._buffer, curve)
        except zmq.ZMQError as error:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {config.endpoint!r} / {config.replay_endpoint!r}: "
                             f"{error}") from None
        self.endpoint = advertised(self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint)
        self.replay_endpoint = advertised(self.replay.endpoint) if self.replay is not None else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    # -- the step loop's side ----------------------------------------------------------------------------
    def publish(self, batch: EventBatch) -> None:
        """Never blocks: a full queue drops the batch (counted)."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
            self.enqueued += 1
        except queue.Full:
            self.dropped += 1

    def shutdown(self, timeout: float = 2.0) -> None:
        self._stop.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    # -- the publisher thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while not self._stop.is_set():
            try:
                if self.zap is not None:
                    self.zap.answer()
                if self.replay is not None:
                    self.replay.serve()
            except Exception:  # noqa: BLE001 -- what clients send must not end the events' thread
                logger.exception("KV events: answering a subscriber failed")
            try:  # a replay in progress sends as its client reads: come back soon
                batch = self._queue.get(timeout=0.005 if self.replay is not None and self.replay.busy else 0.05)
            except queue.Empty:
                continue
            if batch is None:
                break
            try:
                payload = encoder.encode(batch)
            except Exception:  # noqa: BLE001 -- the thread must outlive one bad batch
                logger.exception("KV events: a batch could not be encoded")
                payload = None
            self._send(payload)

    def _send(self, payload: bytes | None) -> None:
        seq = self._next_seq
        self._next_seq += 1
        if payload is None:
            self.dropped += 1
            return
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return
        self._buffer.append((seq, payload))
        self.published += 1

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        for part in (self.replay, self.zap):
            if part is not None:
                part.close()
        self._ctx.term()


class KVEventStream:
    """The engine's end: a recorder on the block manager, flushed to the publisher once per step. With an
    `api_key`, the sockets the publisher binds are CURVE servers keyed from it."""

    def __init__(self, config: KVEventsConfig, block_manager, lora_name_of, api_key: str | None = None) -> None:
        self.publisher = ZmqEventPublisher(config, curve=CurveKeys.from_api_key(api_key) if api_key else None)
        self.recorder = KVEventRecorder(block_manager.block_size, lora_name_of)
        block_manager.events = self.recorder

    def flush(self) -> None:
        batch = self.recorder.take_batch(self.publisher.data_parallel_rank)
        if batch is not None:
            self.publisher.publish(batch)

    def report(self) -> dict:
        """For the engine's /load report: where subscribers connect, and (only when on) that they need CURVE."""
        report = {"endpoint": self.publisher.endpoint, "replay_endpoint": self.publisher.replay_endpoint,
                  "topic": self.publisher.config.topic}
        if self.publisher.curve is not None:
            report["auth"] = AUTH_CURVE
        return report

    def shutdown(self) -> None:
        self.flush()
        self.publisher.shutdown()
