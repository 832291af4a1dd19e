"""The replay socket of the KV-event publisher: vLLM's protocol, with bounded clients and memory.

vLLM's protocol: a request `[b"", 8-byte start sequence]` (a DEALER's or a REQ's) is answered with
`[b"", seq, payload]` for each buffered batch from `start` on, then `[b"", seq -1, b""]`.

A ROUTER queues what it sends to a client until that client reads it: a client that asks and never reads
would hold a copy of the buffer in the engine (vLLM: up to the 1,000 batches of its high-water mark), and a
hundred such clients a hundred copies. Here an answer is a session that sends only as fast as its client
reads (ROUTER_MANDATORY: a full pipe says so instead of dropping; `client_hwm` batches per client), at most
`max_clients` sessions at a time, each ended after `session_s`. `held` counts the batches of every answer
admitted since the socket was made (all it can have sent, read or not) and never passes `max_held`, two full
buffers by default: a request that would pass it is not answered. Once a full answer no longer fits and no
session runs, the socket is made anew on the same address `flush_s` after the last session ended (a client
that reads has its answer by then): whatever unread clients still hold goes with the old one. A legitimate
subscriber at worst gets no answer and counts the batches as missed; the live stream is not touched.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kubeinfer.common.kv_events_curve import CurveKeys

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_CLIENTS = 4  # sessions at a time
CLIENT_HWM = 256  # batches queued per client before its pipe is full
HELD_BUFFERS = 2  # answers admitted between resets hold at most this many full buffers of batches
SESSION_S = 10.0  # an answer that takes longer is abandoned
FLUSH_S = 1.0  # after the last session, before a reset may drop what clients still hold
REQUEST_BYTES = 4096  # a request is 8 bytes (CURVE handshakes need a few hundred); more is a disconnect
REQUESTS_PER_CALL = 64
REBIND_WARN_S = 5.0


@dataclass
class Session:
    peer: bytes
    entries: list[tuple[int, bytes]]  # the buffer from the asked start, when asked (references, not copies)
    deadline: float
    next: int = 0
    queued: int = 0  # messages queued for this client, END included
    ended: bool = False


@dataclass
class ReplayStats:
    admitted: int = 0  # requests answered, or being answered
    answered: int = 0  # sessions that sent their end marker
    refused: int = 0  # requests not answered: too many clients, or the memory budget spent
    abandoned: int = 0  # sessions whose client did not read in time, or went away
    malformed: int = 0
    resets: int = 0


@dataclass
class ReplayServer:
    ctx: zmq.Context
    endpoint: str  # as configured; bound (vLLM always binds the replay endpoint)
    buffer: deque  # (seq, payload) of the publisher, oldest first
    curve: CurveKeys | None = None
    max_clients: int = MAX_CLIENTS
    client_hwm: int = CLIENT_HWM
    max_held: int | None = None  # default: HELD_BUFFERS full answers (the buffer's capacity, plus end markers)
    session_s: float = SESSION_S
    flush_s: float = FLUSH_S
    clock: Callable[[], float] = time.monotonic
    stats: ReplayStats = field(default_factory=ReplayStats)

    def __post_init__(self) -> None:
        if self.max_held is None:
            self.max_held = HELD_BUFFERS * ((self.buffer.maxlen or len(self.buffer)) + 1)
        self.sessions: dict[bytes, Session] = {}
        self.held = 0  # batches of the answers admitted since the socket was made: all they can have sent
        self._last_end = 0.0
        self._rebind_since: float | None = None
        self._rebind_warned = False
        self._closed = False
        self.socket: zmq.Socket | None = None
        self._bind(self.endpoint)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)  # a `*` port resolved, for resets

    def _bind(self, endpoint: str) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, self.client_hwm)
        sock.setsockopt(zmq.RCVHWM, REQUESTS_PER_CALL)
        sock.setsockopt(zmq.MAXMSGSIZE, REQUEST_BYTES)
        if self.curve is not None:
            self.curve.serve(sock)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError:
            sock.close(0)
            raise
        self.socket = sock

    @property
    def busy(self) -> bool:
        return bool(self.sessions)

    # -- the publisher thread's calls --------------------------------------------------------------------
    def serve(self) -> None:
        """Read waiting requests, send what clients can take, end late sessions; never blocks."""
        if self.socket is None:
            if self._closed:
                return
            self._rebind()
            if self.socket is None:
                return
        for _ in range(REQUESTS_PER_CALL):
            if not self.socket.poll(0):
                break
            self._request(self.socket.recv_multipart())
        now = self.clock()
        for peer, session in list(self.sessions.items()):
            self._push(session)
            if session.ended or now > session.deadline:
                if not session.ended:
                    self.stats.abandoned += 1
                del self.sessions[peer]
                self._last_end = now
        spent = self.held + len(self.buffer) + 1 > self.max_held  # a full answer no longer fits
        if spent and not self.sessions and now - self._last_end >= self.flush_s:
            self._reset()

    def close(self) -> None:
        self._closed = True
        if self.socket is not None:
            self.socket.close(0)
            self.socket = None

    # -- inside ----------------------------------------------------------------------------------------------
    def _request(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.stats.malformed += 1
            return
        peer, start = frames[0], int.from_bytes(frames[2], "big")
        if peer in self.sessions:  # one answer at a time per client
            self.stats.refused += 1
            return
        entries = [(seq, payload) for seq, payload in list(self.buffer) if seq >= start]
        cost = len(entries) + 1  # all it sends, end marker included
        if len(self.sessions) >= self.max_clients or self.held + cost > self.max_held:
            self.stats.refused += 1
            if self.stats.refused == 1 or self.stats.refused % 1000 == 0:
                logger.warning("KV events: a replay request was not answered (%d clients, %d of %d batches "
                               "held; %d refused so far)", len(self.sessions), self.held, self.max_held,
                               self.stats.refused)
            return
        self.held += cost
        self.stats.admitted += 1
        self.sessions[peer] = Session(peer, entries, self.clock() + self.session_s)

    def _push(self, session: Session) -> None:
        while not session.ended:
            if session.next < len(session.entries):
                seq, payload = session.entries[session.next]
                frames = (session.peer, b"", seq.to_bytes(8, "big"), payload)
            else:
                frames = (session.peer, b"", END_SEQ, b"")
            try:
                self.socket.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # its pipe is full: the client has not read yet
                return
            except zmq.ZMQError:  # EHOSTUNREACH: the client is gone
                session.entries, session.deadline = [], 0.0
                return
            session.queued += 1
            if session.next < len(session.entries):
                session.next += 1
            else:
                session.ended = True
                self.stats.answered += 1
        session.entries = []

    def _reset(self) -> None:
        """A new socket on the same address: what clients left unread is freed with the old one."""
        self.socket.close(0)
        self.socket = None
        self.held = 0
        self.stats.resets += 1
        self._rebind()

    def _rebind(self) -> None:
        """ZMQ closes a socket's listener on its own thread: the address may be busy for a moment. Tried at each
        call of `serve` until it is free (logged once if that takes long)."""
        try:
            self._bind(self.endpoint)
            self._rebind_since = None
        except zmq.ZMQError as error:
            now = self.clock()
            if self._rebind_since is None:
                self._rebind_since = now
            elif now - self._rebind_since > REBIND_WARN_S and not self._rebind_warned:
                self._rebind_warned = True
                logger.error("KV events: the replay socket cannot be bound again at %s (%s); replay is off until "
                             "it can", self.endpoint, error)
