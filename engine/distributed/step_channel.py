"""Rank 0 hands each step to the other ranks: one pickled message per step over a TCP connection to each.

A worker connects to rank 0 once and then blocks on `recv` while the server is idle (no collective
times out then); a closed connection is how each side learns that the other is gone. A step message is
the step's host lists (model_runner.StepInputs, a few KB at batch 32), so pickling and one `sendall`
per worker cost tens of microseconds (benchmarks/bench_tensor_parallel.py measures it). The port must
be reachable only inside the group: what comes through it is trusted (pickle)."""
from __future__ import annotations

import pickle
import socket
import struct
import time

_HEADER = struct.Struct("!Q")


class StepSender:
    """Rank 0's side: listens, then holds one connection per other rank, in rank order."""

    def __init__(self, host: str, port: int) -> None:
        self._server = socket.create_server((host, port), reuse_port=False)
        self.port = self._server.getsockname()[1]
        self.connections: dict[int, socket.socket] = {}

    def accept(self, ranks: list[int], timeout_s: float) -> None:
        """Wait for each of `ranks` to connect (they say who they are first)."""
        self._server.settimeout(timeout_s)
        while set(ranks) - set(self.connections):
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                missing = sorted(set(ranks) - set(self.connections))
                raise TimeoutError(f"tensor-parallel ranks {missing} did not connect within {timeout_s:.0f} s "
                                   "(--distributed-timeout)") from None
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(None)
            rank = _HEADER.unpack(_read_exactly(conn, _HEADER.size))[0]
            self.connections[rank] = conn
        self._server.close()

    def send(self, message: object) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        frame = _HEADER.pack(len(data)) + data
        for conn in self.connections.values():
            conn.sendall(frame)

    def close(self) -> None:
        for conn in self.connections.values():
            with _quiet():
                conn.close()
        with _quiet():
            self._server.close()


class StepReceiver:
    """A worker's side: connects to rank 0 (retrying while it starts) and reads its messages."""

    def __init__(self, host: str, port: int, rank: int, timeout_s: float) -> None:
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
        self._conn.settimeout(None)
        self._conn.sendall(_HEADER.pack(rank))

    def recv(self) -> object:
        """The next message; ConnectionError when rank 0 is gone."""
        size = _HEADER.unpack(_read_exactly(self._conn, _HEADER.size))[0]
        return pickle.loads(_read_exactly(self._conn, size))

    def close(self) -> None:
        with _quiet():
            self._conn.close()


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n
    return bytes(buffer)


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
