"""Issue #44, finding 4: each replay client that did not read held up to 1,000 batches in the engine (150 such
clients: RSS 44 -> 83 MiB and growing). Replay clients are now bounded in number and in the batches held for
them (kubeinfer/engine/core/kv_event_replay.py). Counted in batches sent to clients, not in RSS."""
from __future__ import annotations

import time
from collections import deque

import pytest
import zmq
from kv_events_helpers import LOCAL, WAIT_S, replay

from kubeinfer.engine.core.kv_event_publisher import KVEventsConfig, ZmqEventPublisher
from kubeinfer.engine.core.kv_event_replay import ReplayServer
from kubeinfer.engine.core.kv_events import AllBlocksCleared, KVEventBatch


class CountingSocket:
    """The replay ROUTER, counting the messages it accepted for clients (each is held until its client reads)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock, self.sent = sock, 0

    def send_multipart(self, frames, flags=0):
        self.sock.send_multipart(frames, flags=flags)
        self.sent += 1

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _wait(done, wait_s: float = WAIT_S) -> bool:
    deadline = time.time() + wait_s
    while time.time() < deadline:
        if done():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def publisher():
    made = []

    def make(buffer_steps: int, batches: int) -> ZmqEventPublisher:
        made.append(ZmqEventPublisher(KVEventsConfig.parse({**LOCAL, "buffer_steps": buffer_steps})))
        for _ in range(batches):
            made[-1].publish(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
        assert _wait(lambda: made[-1]._next_seq == batches)
        return made[-1]
    yield make
    for p in made:
        p.shutdown()


def _non_readers(ctx: zmq.Context, endpoint: str, n: int, rcvbuf: int = -1) -> list[zmq.Socket]:
    """Replay clients that ask for everything and never read."""
    clients = []
    for _ in range(n):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, rcvbuf)
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        clients.append(sock)
    return clients


def test_replay_clients_that_never_read_hold_a_bounded_number_of_batches(publisher):
    p = publisher(buffer_steps=500, batches=500)
    server = p.replay
    counting = server.socket = CountingSocket(server.socket)  # before any request: the thread only reads it
    ctx = zmq.Context()
    clients = _non_readers(ctx, p.replay_endpoint, 150)
    try:
        assert _wait(lambda: server.stats.admitted + server.stats.refused == 150)
        time.sleep(0.3)  # the admitted answers send what they can
        # Before: 150 x 501 messages queued for clients (up to 1,000 each held by ZMQ). Now: two full answers at
        # most until the socket is made anew, whatever the number of clients.
        assert counting.sent <= server.max_held == 2 * 501
        assert server.held <= server.max_held and server.stats.admitted <= 2 and server.stats.refused >= 148
    finally:
        for sock in clients:
            sock.close(0)
        ctx.term()
    # The budget spent and no answer running, the socket is made anew (dropping what unread clients held), and
    # a client that reads gets its whole answer again.
    assert _wait(lambda: server.stats.resets >= 1)
    assert [seq for seq, _ in replay(p.replay_endpoint, 0)] == list(range(500))


def test_at_most_max_clients_answers_run_and_a_stalled_one_ends():
    """Payloads large enough that kernel buffers cannot take a whole answer: clients that never read stall."""
    ctx = zmq.Context()
    big = b"x" * (1 << 20)
    server = ReplayServer(ctx, "tcp://127.0.0.1:*", deque([(i, big) for i in range(64)], maxlen=64),
                          max_clients=2, client_hwm=2, session_s=0.5, flush_s=0.1)
    clients = []
    try:
        clients = _non_readers(ctx, server.endpoint, 5, rcvbuf=4096)
        running = 0
        deadline = time.time() + 0.4
        while time.time() < deadline:
            server.serve()
            running = max(running, len(server.sessions))
            time.sleep(0.01)
        assert running == 2 and server.stats.refused == 3 and server.stats.answered == 0
        assert _wait(lambda: (server.serve(), server.stats.abandoned)[1] == 2, wait_s=3.0)
        assert not server.sessions
    finally:
        for sock in clients:
            sock.close(0)
        server.close()
        ctx.term()
