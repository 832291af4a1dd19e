"""One pod's KV-event stream as the subscriber (kv_event_subscriber.py) keeps it: its SUB socket and the monitor
that says when its connection is up or down, its place in the pod's sequence, a replay in flight, and its fault
pause and counts. Opening and closing the sockets lives here, so no socket outlives its stream."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from kubeinfer.common.kv_events_curve import AUTH_CURVE, CurveKeys

from .kv_event_fetch import MAX_MESSAGE_BYTES, Fetch
from .kv_event_sources import EventSource

SUB_RCVHWM = 1_000
FAULT_PAUSE_S = 10.0
MAX_FAULT_PAUSE_S = 300.0


@dataclass
class Stream:
    source: EventSource
    sub: zmq.Socket | None
    monitor: zmq.Socket | None
    last_seq: int | None = None
    connected: bool = False
    down_since: float | None = None
    fetch: Fetch | None = None  # a replay in flight
    pending: list[tuple[int, bytes]] = field(default_factory=list)  # live messages that came during it
    paused_until: float | None = None  # set aside after a fault: its messages are ignored until then
    faults_in_a_row: int = 0
    last_fault: float = float("-inf")
    stats: dict = field(default_factory=lambda: {"batches": 0, "gaps": 0, "replayed": 0, "missed": 0, "bad": 0,
                                                 "restarts": 0, "jumps": 0, "faults": 0, "ignored": 0})

    def set_aside(self, now: float, base_pause: float, bad_message: bool = False) -> float:
        """After a fault: start over from the next message once a pause has passed, a pause that doubles with
        each fault in a row (up to MAX_FAULT_PAUSE_S); returns it."""
        if now - self.last_fault > MAX_FAULT_PAUSE_S:
            self.faults_in_a_row = 0
        pause = min(MAX_FAULT_PAUSE_S, base_pause * 2 ** self.faults_in_a_row)
        self.faults_in_a_row += 1
        self.last_fault = now
        self.stats["faults"] += 1
        if bad_message:
            self.stats["bad"] += 1
        self.pending, self.last_seq, self.paused_until = [], None, now + pause
        return pause


def open_stream(ctx: zmq.Context, source: EventSource, curve: CurveKeys | None, now: float) -> Stream:
    """A SUB socket on `source` (as the CURVE client when it announces CURVE) with its connection monitor;
    down until the monitor says it connected."""
    sub, monitor = ctx.socket(zmq.SUB), None
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RECONNECT_IVL, 200)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.RCVHWM, SUB_RCVHWM)
        if source.auth == AUTH_CURVE:
            curve.client(sub)
        sub.setsockopt_string(zmq.SUBSCRIBE, source.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(source.endpoint)
    except BaseException:  # whatever the source holds: no socket left open (the context could not end)
        if monitor is not None:
            sub.disable_monitor()
            monitor.close(0)
        sub.close(0)
        raise
    return Stream(source, sub, monitor, down_since=now)


def close_sockets(stream: Stream) -> None:
    stream.sub.disable_monitor()
    stream.monitor.close(0)
    stream.sub.close(0)


def read_monitor(stream: Stream, clock: Callable[[], float]) -> None:
    """The connection's ups and downs since the last read: `down_since` is when it went down (None: up)."""
    while stream.monitor.poll(0):
        event = recv_monitor_message(stream.monitor)["event"]
        if event == zmq.EVENT_CONNECTED:
            stream.connected, stream.down_since = True, None
        elif event == zmq.EVENT_DISCONNECTED and stream.connected:
            stream.connected, stream.down_since = False, clock()
