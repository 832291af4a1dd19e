"""Rank 0 hands each step to the other ranks: one message per step over a TCP connection to each.

A worker connects to rank 0 once, proves it holds the group secret and learns that rank 0 does too
(group_auth), and then blocks on `recv` while the server is idle (no collective times out then); a closed
connection is how each side learns that the other is gone. Messages are wire.py's schema, never pickle: a
step message is the step's host lists (model_runner.StepInputs, a few KB at batch 32), so encoding and one
`sendall` per worker cost tens of microseconds (benchmarks/bench_tensor_parallel.py measures it).

Rank 0 admits only the ranks it expects, each once and each authenticated: anything else is refused, logged,
and does not keep the real rank out (the accept loop goes on until every rank has joined or the timeout
passes; each handshake runs on its own thread within HANDSHAKE_TIMEOUT_S). Every send is bounded by the
timeout: a rank that stops reading is a dead rank, not a stall."""
from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
import time

from . import wire
from .group_auth import ACCEPTED, HandshakeError, join_as_worker, read_exactly, verify_worker
from .listen import listen_on

logger = logging.getLogger(__name__)
_HEADER = struct.Struct("!Q")
HANDSHAKE_TIMEOUT_S = 10.0
MAX_PENDING_HANDSHAKES = 16
# An adapter's slot travels whole to every rank (each cuts its own slice): a rank-64 adapter on every module of
# a 70B model is about 3 GB in bf16. msgpack holds at most 4 GiB in one ext (the adapter's record), so a frame
# is at most that and a few bytes; a larger size is refused before anything is allocated.
MAX_MESSAGE_BYTES = (4 << 30) + (1 << 20)


class StepSender:
    """Rank 0's side: listens on `host`, then holds one authenticated connection per other rank, in rank order."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self._server = listen_on(host, port)
        self._secret = secret
        self.port = self._server.getsockname()[1]
        self.connections: dict[int, socket.socket] = {}
        self._lock, self._accepting = threading.Lock(), False

    def accept(self, ranks: list[int], timeout_s: float) -> None:
        """Wait for each of `ranks` to connect and authenticate; sends then time out after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        expected, done = set(ranks), queue.Queue()
        handshake_s = min(HANDSHAKE_TIMEOUT_S, timeout_s)
        self._accepting, pending = True, 0
        self._server.settimeout(0.05)
        try:
            while expected - set(self.connections):
                while not done.empty():
                    pending -= 1
                    if (proved := done.get()) is not None:
                        self._admit(*proved, timeout_s)
                if time.monotonic() > deadline:
                    missing = sorted(expected - set(self.connections))
                    raise TimeoutError(f"tensor-parallel ranks {missing} did not connect and authenticate within "
                                       f"{timeout_s:.0f} s (--distributed-timeout)")
                try:
                    conn, peer = self._server.accept()
                except TimeoutError:
                    continue
                if pending >= MAX_PENDING_HANDSHAKES:
                    _refuse(conn, peer, f"{pending} handshakes already in progress")
                    continue
                pending += 1
                threading.Thread(target=self._handshake, args=(conn, peer, expected, handshake_s, done),
                                 name="tp-handshake", daemon=True).start()
        finally:
            with self._lock:  # handshakes still running close their connections themselves
                self._accepting = False
            while not done.empty():
                if (proved := done.get()) is not None:
                    _refuse(proved[0], proved[1], "the group formed without it")
            self._server.close()

    def _handshake(self, conn: socket.socket, peer, expected: set[int], timeout_s: float, done: queue.Queue) -> None:
        try:
            rank = verify_worker(conn, self._secret, expected, timeout_s)
        except (OSError, HandshakeError) as error:
            _refuse(conn, peer, str(error) or type(error).__name__)
            done.put(None)
            return
        with self._lock:
            if self._accepting:
                done.put((conn, peer, rank))
                return
        _refuse(conn, peer, "the group formed without it")

    def _admit(self, conn: socket.socket, peer, rank: int, timeout_s: float) -> None:
        if rank in self.connections:
            _refuse(conn, peer, f"rank {rank} has already joined (a duplicate id)")
            return
        try:
            conn.sendall(ACCEPTED)
        except OSError as error:
            _refuse(conn, peer, str(error))
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(timeout_s)  # every later send: a rank that does not read for that long is dead
        self.connections[rank] = conn
        logger.info("tensor-parallel rank %d joined from %s", rank, peer)

    def send(self, message: object) -> None:
        """`message` to every rank; TimeoutError naming the rank that did not take it in time."""
        body = wire.encode(message)
        frame = _HEADER.pack(len(body)) + body
        for rank, conn in self.connections.items():
            try:
                conn.sendall(frame)
            except TimeoutError:
                raise TimeoutError(f"tensor-parallel rank {rank} did not take its message within "
                                   f"{conn.gettimeout():.0f} s (--distributed-timeout): it stopped reading") from None

    def close(self) -> None:
        for conn in self.connections.values():
            with _quiet():
                conn.close()
        with _quiet():
            self._server.close()


class StepReceiver:
    """A worker's side: connects to rank 0 (retrying while it starts), authenticates, and reads its messages."""

    def __init__(self, host: str, port: int, rank: int, timeout_s: float, secret: bytes) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._conn = socket.create_connection((host, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank} could not reach rank 0 at {host}:{port} "
                                       f"within {timeout_s:.0f} s") from None
                time.sleep(0.2)
        self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        join_as_worker(self._conn, secret, rank, max(1.0, min(HANDSHAKE_TIMEOUT_S, deadline - time.monotonic())))
        self._conn.settimeout(None)  # idle between requests for as long as the server is

    def recv(self) -> object:
        """The next message; ConnectionError when rank 0 is gone, wire.WireError for one outside the schema."""
        size = _HEADER.unpack(read_exactly(self._conn, _HEADER.size))[0]
        if size > MAX_MESSAGE_BYTES:
            raise wire.WireError(f"a message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
        return wire.decode(read_exactly(self._conn, size))

    def close(self) -> None:
        with _quiet():
            self._conn.close()


def _refuse(conn: socket.socket, peer, why: str) -> None:
    logger.warning("tensor-parallel step channel: refused %s: %s", peer, why)
    with _quiet():
        conn.close()


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
