"""Follows every engine's KV events into the block index, on a thread of its own (never on the request path).

Sources come from the endpoint pool at each refresh (kv_event_sources.py: an engine's `/load` report, checked;
vLLM at `tcp://HOST:--kv-events-port`). One SUB socket per pod (the message does not say who sent it). An
engine that announces `"auth": "curve"` is subscribed as the CURVE client keyed from the engine API key
(kubeinfer/common/kv_events_curve.py); without that key the gateway cannot follow it and says so once.

Sequence numbers: a gap (a batch dropped by the engine or by ZMQ) asks the pod's replay socket for the
missing batches before applying the one that arrived; the first message from a pod asks for what is still
buffered, so an engine that was serving before the gateway started is known at once. A replay asks for at
most MAX_REPLAY batches and runs on this thread's poller (kv_event_fetch.py: bounded in frames and seconds),
the pod's live batches held meanwhile; other pods go on. A number that goes backwards is an engine that
restarted, one that jumps more than MAX_REPLAY ahead cannot be replayed: either way the pod starts over.
Lost streams: ZMQ reconnects by itself; a socket monitor says when the connection is down. A pod whose
connection stays down longer than `lost_after` seconds, or that leaves the pool, has its blocks dropped:
a stale index routes requests to caches that are gone. A lost pod's socket is made anew at the next refresh.

Faults stay with their pod: a message or batch out of the wire contract (kv_event_wire.py checks every
field), a replay out of protocol, events the index refuses, or anything else that goes wrong with one pod's
stream sets that pod aside: it is forgotten (scored approximately), its messages are ignored for a pause that
doubles with each fault in a row (kv_event_stream.py), then it starts over. Messages are
capped at MAX_MESSAGE_BYTES (ZMQ drops the connection of a peer that sends more), the index per pod.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import zmq

from kubeinfer.common.kv_events_curve import AUTH_CURVE, CurveKeys

from .kv_block_index import IndexFault, KVBlockIndex
from .kv_event_fetch import FETCH_DEADLINE_S, MAX_MESSAGE_BYTES, Fetch, ReplayError
from .kv_event_sources import DEFAULT_EVENTS_PORT, EventSource, sources_from_pool
from .kv_event_stream import FAULT_PAUSE_S, Stream, close_sockets, open_stream, read_monitor
from .kv_event_wire import Batch, WireError, decode_batch

__all__ = ["DEFAULT_EVENTS_PORT", "EventSource", "KVEventSubscriber", "Stream", "sources_from_pool"]

logger = logging.getLogger(__name__)
MAX_REPLAY = 10_000  # batches one replay asks for at most (vLLM's default buffer_steps)
MAX_PENDING = 1_000  # live batches held while a replay is in flight; more ends the replay
MESSAGES_PER_CALL = 1_000  # live messages read from one pod per round: the others' turn comes in between


class KVEventSubscriber:
    def __init__(self, index: KVBlockIndex, sources: Callable[[], dict[str, EventSource]],
                 lost_after: float = 30.0, refresh: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 curve_key: str | None = None, fault_pause: float = FAULT_PAUSE_S) -> None:
        """`curve_key`: the engine API key (KUBEINFER_ENGINE_API_KEY), to follow engines that announce CURVE."""
        self.index, self.sources, self.lost_after, self.refresh, self.clock = index, sources, lost_after, refresh, clock
        self.curve = CurveKeys.from_api_key(curve_key) if curve_key else None
        self.fault_pause = fault_pause
        self.streams: dict[str, Stream] = {}
        self.unfollowed: dict[str, EventSource] = {}  # pods not followed until their source changes
        self.dropped_pods = 0  # pods whose blocks were dropped for a lost stream
        self._closed: Counter = Counter()  # the counts of streams closed since
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
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
        while not self._stop.is_set():
            try:
                now = self.clock()
                if now >= next_refresh:
                    self._sync()
                    next_refresh = now + self.refresh
                self._round(50)
            except Exception:  # noqa: BLE001 -- this thread follows every pod: it outlives any one round
                logger.exception("KV events: a round of the subscriber failed; carrying on")
                next_refresh = 0.0
                self._stop.wait(0.1)

    def step(self, wait_ms: int = 50) -> None:
        """One round of the thread's work, for tests that drive it without the thread."""
        self._sync()
        self._round(wait_ms)

    def _round(self, wait_ms: int) -> None:
        try:
            ready = dict(self._poller.poll(wait_ms))
        except zmq.ZMQError:  # a socket closed under the poller: the next refresh makes a new one
            self._stop.wait(wait_ms / 1000)
            return
        for pod, stream in list(self.streams.items()):
            try:
                if stream.monitor in ready:
                    read_monitor(stream, self.clock)
                if stream.sub in ready:
                    self._drain(pod, stream)
                if stream.fetch is not None:
                    self._on_fetch(pod, stream)
            except Exception as error:  # noqa: BLE001 -- whatever one pod's stream does stays with that pod
                self._fault(pod, stream, error)
        self._expire()

    def _sync(self) -> None:
        try:
            wanted = self.sources()
        except Exception:  # noqa: BLE001 -- the pool is read while it changes; next refresh
            logger.exception("KV events: reading the endpoint pool failed")
            wanted = {pod: s.source for pod, s in self.streams.items()}
        for pod in list(self.streams):
            if wanted.get(pod) != self.streams[pod].source:
                self._close(pod)
                self.index.drop(pod)
        for pod in [p for p, source in self.unfollowed.items() if wanted.get(p) != source]:
            del self.unfollowed[pod]
        for pod, source in wanted.items():
            if pod not in self.streams and pod not in self.unfollowed:
                try:
                    self._open(pod, source)
                except Exception as error:  # noqa: BLE001 -- one pod's address must not stop the others
                    logger.warning("KV events: cannot follow %s at %s: %s", pod, source.endpoint, error)
                    self.unfollowed[pod] = source
        self._poller = zmq.Poller()
        for stream in self.streams.values():
            self._poller.register(stream.sub, zmq.POLLIN)
            self._poller.register(stream.monitor, zmq.POLLIN)
            if stream.fetch is not None:
                self._poller.register(stream.fetch.socket, zmq.POLLIN)

    def _open(self, pod: str, source: EventSource) -> None:
        if source.auth == AUTH_CURVE and self.curve is None:
            logger.warning("KV events: %s publishes only to holders of the engine API key (CURVE); this gateway "
                           "has none (KUBEINFER_ENGINE_API_KEY): its prefixes are scored approximately", pod)
            self.unfollowed[pod] = source
            return
        self.streams[pod] = open_stream(self._ctx, source, self.curve, self.clock())
        logger.info("KV events: following %s at %s%s", pod, source.endpoint,
                    " (CURVE)" if source.auth == AUTH_CURVE else "")

    def totals(self) -> Counter:
        """Every stream's counts together, those of closed streams included (for the gateway's counters)."""
        totals = Counter(self._closed)
        for stream in list(self.streams.values()):
            totals.update(stream.stats)
        return totals

    def _close(self, pod: str) -> None:
        stream = self.streams.pop(pod)
        self._closed.update(stream.stats)
        self._end_fetch(stream)
        for sock in (stream.sub, stream.monitor):
            self._unregister(sock)
        close_sockets(stream)

    def _expire(self) -> None:
        now = self.clock()
        for pod, stream in list(self.streams.items()):
            if stream.down_since is not None and now - stream.down_since > self.lost_after and (
                    pod in self.index.pods or stream.last_seq is not None):
                logger.warning("KV events: %s unreachable for %.0f s: its blocks are dropped", pod,
                               now - stream.down_since)
                self.index.drop(pod)
                self.dropped_pods += 1
                # A new socket at the next refresh starts it over (replaying its buffer) once it is back; ZMQ
                # itself never reconnects after a protocol error (a message past MAX_MESSAGE_BYTES, say).
                self._close(pod)

    # -- one pod's messages ------------------------------------------------------------------------------------
    def _drain(self, pod: str, stream: Stream) -> None:
        for _ in range(MESSAGES_PER_CALL):
            if not stream.sub.poll(0):
                return
            frames = stream.sub.recv_multipart()
            if stream.paused_until is not None:
                if self.clock() < stream.paused_until:
                    stream.stats["ignored"] += 1
                    continue
                stream.paused_until = None
            if len(frames) != 3 or len(frames[1]) != 8:
                raise WireError(f"a message of {len(frames)} parts, not [topic, 8-byte seq, payload]")
            self._receive(pod, stream, int.from_bytes(frames[1], "big"), frames[2])

    def _receive(self, pod: str, stream: Stream, seq: int, payload: bytes) -> None:
        if stream.fetch is not None:  # a replay first: this one after it, in order
            stream.pending.append((seq, payload))
            if len(stream.pending) > MAX_PENDING:
                self._finish_fetch(pod, stream)
            return
        batch = decode_batch(payload)
        last = stream.last_seq
        if last is not None and seq <= last:  # numbering started over: a new engine process
            stream.stats["restarts"] += 1
            self.index.drop(pod)
            last = None
        elif last is not None and seq - last > MAX_REPLAY:  # more missed than any replay returns: start over
            stream.stats["jumps"] += 1
            logger.warning("KV events: %s jumped from sequence %d to %d: its blocks are dropped", pod, last, seq)
            self.index.drop(pod)
            last = None
        start = None
        if last is None:
            self.index.apply(pod, [])  # known from now on, even before its first block
            if seq > 0:
                start = max(0, seq - MAX_REPLAY)
        elif seq > last + 1:
            stream.stats["gaps"] += 1
            start = last + 1
        if start is not None:
            if stream.source.replay_endpoint and self._begin_fetch(stream, start, seq, batch):
                return
            stream.stats["missed"] += seq - start
        self._apply(pod, stream, seq, batch)

    def _apply(self, pod: str, stream: Stream, seq: int, batch: Batch) -> None:
        self.index.apply(pod, batch.events)
        stream.stats["batches"] += 1
        stream.last_seq = seq

    # -- replays -----------------------------------------------------------------------------------------------
    def _begin_fetch(self, stream: Stream, start: int, seq: int, batch: Batch) -> bool:
        curve = self.curve if stream.source.auth == AUTH_CURVE else None
        try:
            fetch = Fetch.open(self._ctx, stream.source.replay_endpoint, start, seq,
                               self.clock() + FETCH_DEADLINE_S, curve)
        except zmq.ZMQError as error:
            logger.warning("KV events: replay from %s failed: %s", stream.source.replay_endpoint, error)
            return False
        fetch.then = (seq, batch)
        stream.fetch = fetch
        self._poller.register(fetch.socket, zmq.POLLIN)
        return True

    def _on_fetch(self, pod: str, stream: Stream) -> None:
        fetch = stream.fetch
        for _, payload in fetch.read():
            self.index.apply(pod, decode_batch(payload).events)
            fetch.applied += 1
            stream.stats["replayed"] += 1
        if fetch.done or self.clock() > fetch.deadline:
            self._finish_fetch(pod, stream)

    def _finish_fetch(self, pod: str, stream: Stream) -> None:
        """The replay is over (complete, late or cut short): count what it lacked, then apply the live batch that
        asked for it and those held meanwhile."""
        fetch = stream.fetch
        self._end_fetch(stream)
        stream.stats["missed"] += (fetch.end - fetch.start) - fetch.applied
        seq, batch = fetch.then
        self._apply(pod, stream, seq, batch)
        pending, stream.pending = stream.pending, []
        for seq, payload in pending:
            self._receive(pod, stream, seq, payload)

    def _end_fetch(self, stream: Stream) -> None:
        if stream.fetch is None:
            return
        self._unregister(stream.fetch.socket)
        stream.fetch.close()
        stream.fetch = None

    def _unregister(self, sock: zmq.Socket) -> None:
        try:
            self._poller.unregister(sock)
        except KeyError:
            pass

    # -- faults ------------------------------------------------------------------------------------------------
    def _fault(self, pod: str, stream: Stream, error: Exception) -> None:
        """Set one pod aside: forgotten now, its messages ignored for a while, then it starts over."""
        self._end_fetch(stream)
        pause = stream.set_aside(self.clock(), self.fault_pause, bad_message=isinstance(error, WireError))
        self.index.drop(pod)
        expected = isinstance(error, (WireError, IndexFault, ReplayError))  # else a bug of ours: its traceback
        logger.warning("KV events from %s set aside for %.0f s (%s: %.200s); its prefixes are scored approximately",
                       pod, pause, type(error).__name__, error, exc_info=None if expected else error)
