"""CURVE for the KV-event sockets: keys derived from the engine API key, and the engine's admission check.

KV events carry every cached block's token ids, so they are as private as the prompts. Where the engine has
an API key (`--api-key`, env KUBEINFER_API_KEY) its bound KV-event sockets (PUB and replay) are ZMQ CURVE
servers; the gateway holds the same key (env KUBEINFER_ENGINE_API_KEY, one Kubernetes Secret for both) and
connects as the one CURVE client. Both keypairs are derived from the key, so no new Secret is needed:
secret = HMAC-SHA256(api key, label), public = Curve25519 of the secret.

Neither public key is ever published. A client must know the server's public key to finish the handshake and
the engine's ZAP handler admits only the derived client key, so a subscriber needs the API key twice over; and
the gateway, deriving the server key itself, also knows it talks to a holder of the key (the events it indexes
cannot come from an impostor at the pod's address). The engine sets ZAP_ENFORCE_DOMAIN: were its ZAP handler
gone, libzmq would refuse every client rather than admit any. The labels carry a version: a new derivation
gets new labels, never new meanings for old ones.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

logger = logging.getLogger(__name__)

AUTH_CURVE = "curve"  # the engine's /load `kv_events.auth` when its sockets are CURVE servers
ZAP_DOMAIN = b"kubeinfer-kv-events"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks, per context (RFC 27)
SERVER_LABEL = b"kubeinfer kv-events curve server v1"
CLIENT_LABEL = b"kubeinfer kv-events curve client v1"


@dataclass(frozen=True)
class CurveKeys:
    """The server and client keypairs of one API key, z85-encoded (40 bytes each) as ZMQ takes them."""
    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)

    @classmethod
    def from_api_key(cls, key: str) -> CurveKeys:
        if not key:
            raise ValueError("CURVE keys need a non-empty API key")
        server_secret, client_secret = (z85.encode(hmac.new(key.encode(), label, hashlib.sha256).digest())
                                        for label in (SERVER_LABEL, CLIENT_LABEL))
        return cls(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)

    def serve(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server whose clients the context's ZAP handler must admit (before bind)."""
        sock.curve_secretkey = self.server_secret
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def client(self, sock: zmq.Socket) -> None:
        """Make `sock` the CURVE client the engine admits (before connect)."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret


class ZapGate:
    """The engine's ZAP handler (RFC 27): admits a CURVE client only with the derived client key. One REP
    socket in the publisher's context, answered from the publisher's thread (`answer`, never blocking)."""

    MAX_PER_CALL = 64  # handshakes answered per call: the publisher's thread has other work too

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        self._allowed = z85.decode(keys.client_public)
        self.admitted = self.refused = 0
        self.socket = ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)  # before any CURVE socket accepts a connection

    def answer(self) -> None:
        for _ in range(self.MAX_PER_CALL):
            if not self.socket.poll(0):
                return
            frames = self.socket.recv_multipart()
            request_id = frames[1] if len(frames) > 1 else b""
            ok = (len(frames) == 7 and frames[0] == b"1.0" and frames[2] == ZAP_DOMAIN and frames[5] == b"CURVE"
                  and hmac.compare_digest(frames[6], self._allowed))
            if ok:
                self.admitted += 1
            else:
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:  # bounded: a scanner must not flood the log
                    address = frames[3].decode("ascii", "replace")[:64] if len(frames) > 3 else "?"
                    logger.warning("KV events: refused a subscriber from %s without the gateway's key "
                                   "(%d refused so far)", address, self.refused)
            self.socket.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                        b"OK" if ok else b"not the gateway's key", b"gateway" if ok else b"", b""])

    def close(self) -> None:
        self.socket.close(0)
