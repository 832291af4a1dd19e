"""One replay request in flight to an engine's replay socket: bounded in frames, bytes and seconds.

vLLM's protocol: `[b"", 8-byte start]` from a DEALER; the answer `[b"", seq, payload]` per buffered batch from
`start` on, then `[b"", -1, b""]`. The subscriber asks for the batches [start, end) it missed; a fetch reads
the answer as it arrives, on the subscriber's poller, so one slow or endless replay server holds up no other
pod. A frame must be in vLLM's shape with a sequence number above the last one and at least `start` (else
ReplayError: the pod is set aside); the fetch ends at the end marker, once it has `end - 1` or anything later
(a server sends what it buffered after `end` too: not needed), or at its deadline. So it takes at most
`end - start` frames of at most MAX_MESSAGE_BYTES each, and never waits past `deadline`.
"""
from __future__ import annotations

from dataclasses import dataclass

import zmq

from kubeinfer.common.kv_events_curve import CurveKeys

END_SEQ = -1
MAX_MESSAGE_BYTES = 8 << 20  # one frame (a batch's payload): a long prompt's prefill is a few MB at most
FETCH_DEADLINE_S = 5.0
FRAMES_PER_CALL = 256  # frames read per poll round: the other pods' turn comes in between
RCVHWM = 64  # frames ZMQ reads ahead of us


class ReplayError(ValueError):
    """A replay answer that breaks the protocol."""


@dataclass
class Fetch:
    socket: zmq.Socket
    start: int
    end: int
    deadline: float
    then: tuple[int, object] | None = None  # the live batch (seq, decoded) that asked for the fetch, applied after
    last_seq: int = -1
    applied: int = 0  # counted by the subscriber
    done: bool = False

    @classmethod
    def open(cls, ctx: zmq.Context, endpoint: str, start: int, end: int, deadline: float,
             curve: CurveKeys | None) -> Fetch:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        if curve is not None:
            curve.client(sock)
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            sock.close(0)
            raise
        return cls(sock, start, end, deadline)

    def read(self) -> list[tuple[int, bytes]]:
        """The batches in [start, end) that arrived since the last call, in order; `done` once the answer is
        complete or no more is needed. ReplayError on a frame out of protocol."""
        out = []
        for _ in range(FRAMES_PER_CALL):
            if self.done or not self.socket.poll(0):
                break
            frames = self.socket.recv_multipart()
            if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
                raise ReplayError(f"a replay frame of {len(frames)} parts, not [b'', seq, payload]")
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == END_SEQ:
                self.done = True
                break
            if seq <= self.last_seq or seq < self.start:
                raise ReplayError(f"replayed sequence {seq} after {self.last_seq} (asked from {self.start})")
            self.last_seq = seq
            if seq >= self.end:
                self.done = True
                break
            out.append((seq, frames[2]))
            if seq == self.end - 1:
                self.done = True
        return out

    def close(self) -> None:
        self.socket.close(0)
