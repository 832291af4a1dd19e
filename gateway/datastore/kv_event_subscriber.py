"""Follows every engine's KV events into the block index, on a thread of its own (never on the request path).

Sources come from the endpoint pool at each refresh: an engine whose `/load` report names its events
(`kv_events.endpoint`, ours) is subscribed there; one read from Prometheus text (vLLM, which does not say)
at `tcp://HOST:--kv-events-port` on the pod's address; an engine whose report says `kv_events: null`
publishes nothing and is not subscribed. One SUB socket per pod (the message does not say who sent it).

Sequence numbers: a gap (a batch dropped by the engine or by ZMQ) asks the pod's replay socket for the
missing batches before applying the one that arrived; the first message from a pod asks for everything
still buffered, so an engine that was serving before the gateway started is known at once. A number that
goes backwards is an engine that restarted: its old blocks are dropped.
Lost streams: ZMQ reconnects by itself; a socket monitor says when the connection is down. A pod whose
connection stays down longer than `lost_after` seconds, or that leaves the pool, has its blocks dropped:
a stale index routes requests to caches that are gone.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from .kv_block_index import KVBlockIndex
from .kv_event_wire import WireError, decode_batch

logger = logging.getLogger(__name__)
END_SEQ = -1
DEFAULT_EVENTS_PORT = 5557  # vLLM's default `endpoint` (tcp://*:5557)
REPLAY_WAIT_S = 2.0


@dataclass(frozen=True)
class EventSource:
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def sources_from_pool(pool, events_port: int = DEFAULT_EVENTS_PORT) -> dict[str, EventSource]:
    """Each scraped endpoint's events source: what its /load report names, else (Prometheus text: vLLM)
    the pod's host at `events_port`."""
    sources = {}
    for endpoint in list(pool):
        state = endpoint.state
        if state is None:
            continue
        if state.load_report:
            report = state.kv_events
            if report:
                sources[endpoint.address] = EventSource(report["endpoint"], report.get("replay_endpoint"),
                                                        report.get("topic") or "")
        elif events_port:
            host = endpoint.address.rsplit(":", 1)[0]
            sources[endpoint.address] = EventSource(f"tcp://{host}:{events_port}")
    return sources


@dataclass
class Stream:
    source: EventSource
    sub: zmq.Socket
    monitor: zmq.Socket
    last_seq: int | None = None
    connected: bool = False
    down_since: float | None = None
    stats: dict = field(default_factory=lambda: {"batches": 0, "gaps": 0, "replayed": 0, "missed": 0,
                                                 "bad": 0, "restarts": 0})


class KVEventSubscriber:
    def __init__(self, index: KVBlockIndex, sources: Callable[[], dict[str, EventSource]],
                 lost_after: float = 30.0, refresh: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.index, self.sources, self.lost_after, self.refresh, self.clock = index, sources, lost_after, refresh, clock
        self.streams: dict[str, Stream] = {}
        self.dropped_pods = 0  # pods whose blocks were dropped for a lost stream
        self._closed: Counter = Counter()  # the counts of streams closed since
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kv-events-subscriber", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for pod in list(self.streams):
            self._close(pod)
        self._ctx.term()

    # -- the thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        next_refresh = 0.0
        poller = zmq.Poller()
        while not self._stop.is_set():
            now = self.clock()
            if now >= next_refresh:
                poller = self._sync()
                next_refresh = now + self.refresh
            try:
                ready = dict(poller.poll(50))
            except zmq.ZMQError:
                continue
            for pod, stream in list(self.streams.items()):
                if stream.monitor in ready:
                    self._on_monitor(stream)
                if stream.sub in ready:
                    self._drain(pod, stream)
            self._expire()

    def step(self, wait_ms: int = 50) -> None:
        """One round of the thread's work, for tests that drive it without the thread."""
        poller = self._sync()
        ready = dict(poller.poll(wait_ms))
        for pod, stream in list(self.streams.items()):
            if stream.monitor in ready:
                self._on_monitor(stream)
            if stream.sub in ready:
                self._drain(pod, stream)
        self._expire()

    def _sync(self) -> zmq.Poller:
        try:
            wanted = self.sources()
        except Exception:  # noqa: BLE001 -- the pool is read while it changes; next refresh
            logger.exception("KV events: reading the endpoint pool failed")
            wanted = {pod: s.source for pod, s in self.streams.items()}
        for pod in list(self.streams):
            if wanted.get(pod) != self.streams[pod].source:
                self._close(pod)
                self.index.drop(pod)
        for pod, source in wanted.items():
            if pod not in self.streams:
                self._open(pod, source)
        poller = zmq.Poller()
        for stream in self.streams.values():
            poller.register(stream.sub, zmq.POLLIN)
            poller.register(stream.monitor, zmq.POLLIN)
        return poller

    def _open(self, pod: str, source: EventSource) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RECONNECT_IVL, 200)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sub.setsockopt_string(zmq.SUBSCRIBE, source.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(source.endpoint)
        except zmq.ZMQError as error:
            logger.warning("KV events: cannot subscribe to %s at %s: %s", pod, source.endpoint, error)
        self.streams[pod] = Stream(source, sub, monitor, down_since=self.clock())
        logger.info("KV events: following %s at %s", pod, source.endpoint)

    def totals(self) -> Counter:
        """Every stream's counts together, those of closed streams included (for the gateway's counters)."""
        totals = Counter(self._closed)
        for stream in list(self.streams.values()):
            totals.update(stream.stats)
        return totals

    def _close(self, pod: str) -> None:
        stream = self.streams.pop(pod)
        self._closed.update(stream.stats)
        stream.sub.disable_monitor()
        stream.monitor.close(0)
        stream.sub.close(0)

    def _on_monitor(self, stream: Stream) -> None:
        while stream.monitor.poll(0):
            event = recv_monitor_message(stream.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                stream.connected, stream.down_since = True, None
            elif event == zmq.EVENT_DISCONNECTED and stream.connected:
                stream.connected, stream.down_since = False, self.clock()

    def _expire(self) -> None:
        now = self.clock()
        for pod, stream in self.streams.items():
            if stream.down_since is not None and now - stream.down_since > self.lost_after and (
                    pod in self.index.pods or stream.last_seq is not None):
                logger.warning("KV events: %s unreachable for %.0f s: its blocks are dropped", pod, now - stream.down_since)
                self.index.drop(pod)
                stream.last_seq = None  # when it comes back, start over (replay what it still buffers)
                self.dropped_pods += 1

    def _drain(self, pod: str, stream: Stream) -> None:
        while stream.sub.poll(0):
            frames = stream.sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                stream.stats["bad"] += 1
                continue
            self._receive(pod, stream, int.from_bytes(frames[1], "big"), frames[2])

    def _receive(self, pod: str, stream: Stream, seq: int, payload: bytes) -> None:
        last = stream.last_seq
        if last is not None and seq <= last:  # numbering started over: a new engine process
            stream.stats["restarts"] += 1
            self.index.drop(pod)
            last = None
        if last is None:
            self.index.apply(pod, [])  # known from now on, even before its first block
            if seq > 0:
                self._fill(pod, stream, 0, seq)
        elif seq > last + 1:
            stream.stats["gaps"] += 1
            self._fill(pod, stream, last + 1, seq)
        self._apply(pod, stream, payload)
        stream.last_seq = seq

    def _fill(self, pod: str, stream: Stream, start: int, end: int) -> None:
        """Apply the batches [start, end) from the pod's replay socket; count what it no longer has."""
        got = self.replay(stream.source, start, end) if stream.source.replay_endpoint else []
        for _, payload in got:
            self._apply(pod, stream, payload)
        stream.stats["replayed"] += len(got)
        stream.stats["missed"] += (end - start) - len(got)

    def replay(self, source: EventSource, start: int, end: int) -> list[tuple[int, bytes]]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(source.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while sock.poll(int(REPLAY_WAIT_S * 1000)):
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    break
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    break
                if start <= seq < end:
                    out.append((seq, frames[2]))
        except zmq.ZMQError as error:
            logger.warning("KV events: replay from %s failed: %s", source.replay_endpoint, error)
        finally:
            sock.close(0)
        return out

    def _apply(self, pod: str, stream: Stream, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except (WireError, TypeError, ValueError) as error:
            stream.stats["bad"] += 1
            if stream.stats["bad"] == 1:
                logger.warning("KV events from %s: undecodable batch (%s); further ones are only counted", pod, error)
            return
        stream.stats["batches"] += 1
        self.index.apply(pod, batch.events)
