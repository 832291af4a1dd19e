"""Who belongs to a tensor-parallel group: its secret, and the handshake that proves it in both directions
before any message flows on the step channel.

One node: rank 0 draws a random secret and hands it to the ranks it spawns (their process arguments, never
the network). Several nodes: every node reads the same secret from SECRET_ENV (the operator fills it from the
model's Secret); a multi-node engine without one refuses to start.

The handshake (challenge-response with HMAC-SHA256; the secret never crosses the wire):
  worker -> rank 0   HELLO: magic, VERSION, rank id, the worker's nonce
  rank 0 -> worker   rank 0's nonce, HMAC(secret, "rank0" | VERSION | rank | worker nonce | rank 0 nonce)
  worker -> rank 0   HMAC(secret, "worker" | VERSION | rank | rank 0 nonce | worker nonce)
  rank 0 -> worker   ACCEPTED (one byte), once the rank id is one it expects and has not met yet
The two proofs carry different labels, so neither side can be used to forge the other's."""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct

from kubeinfer.common import envs as shared_envs

from .wire import VERSION

SECRET_ENV = shared_envs.TP_SECRET.name
MIN_SECRET_CHARS = 32
MAGIC = b"KITP"
NONCE_BYTES = 32
HELLO = struct.Struct(f"!4sBI{NONCE_BYTES}s")
CHALLENGE = struct.Struct(f"!{NONCE_BYTES}s32s")
PROOF_BYTES = 32
ACCEPTED = b"\x01"


class HandshakeError(RuntimeError):
    """The peer is not a member of this group (or speaks another version); nothing was sent to it."""


def group_secret(nnodes: int) -> bytes:
    """The secret of a group starting here: random on one node, SECRET_ENV's over several."""
    if nnodes == 1:
        return secrets.token_bytes(32)
    value = shared_envs.TP_SECRET.get()
    if len(value) < MIN_SECRET_CHARS:
        state = "is not set" if not value else f"has {len(value)} characters"
        raise ValueError(f"a tensor-parallel group over {nnodes} nodes authenticates its ranks with a shared secret, "
                         f"and {SECRET_ENV} {state}: set it to the same random value of at least {MIN_SECRET_CHARS} "
                         f"characters on every node (e.g. `export {SECRET_ENV}=$(openssl rand -hex 32)`); "
                         "the kubeinfer operator sets it from the model's Secret")
    return value.encode()


def _proof(secret: bytes, label: bytes, rank: int, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + struct.pack("!BI", VERSION, rank) + first + second, hashlib.sha256).digest()


def read_exactly(conn: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n
    return buffer


def join_as_worker(conn: socket.socket, secret: bytes, rank: int, timeout_s: float) -> None:
    """A worker's side; returns once rank 0 has proved itself and accepted this rank."""
    conn.settimeout(timeout_s)
    nonce = secrets.token_bytes(NONCE_BYTES)
    conn.sendall(HELLO.pack(MAGIC, VERSION, rank, nonce))
    try:
        leader_nonce, leader_proof = CHALLENGE.unpack(read_exactly(conn, CHALLENGE.size))
    except ConnectionError:
        raise HandshakeError(f"rank 0 closed the connection instead of answering rank {rank}'s hello "
                             "(another version, or an id it does not expect)") from None
    if not hmac.compare_digest(leader_proof, _proof(secret, b"rank0", rank, nonce, leader_nonce)):
        raise HandshakeError(f"the peer that answered rank {rank} is not this group's rank 0: its proof of the "
                             f"group secret is wrong (is {SECRET_ENV} the same on every node?)")
    conn.sendall(_proof(secret, b"worker", rank, leader_nonce, nonce))
    try:
        verdict = read_exactly(conn, 1)
    except ConnectionError:
        verdict = b""
    if verdict != ACCEPTED:
        raise HandshakeError(f"rank 0 refused rank {rank}: a different group secret, or rank {rank} has already "
                             "joined")


def verify_worker(conn: socket.socket, secret: bytes, expected: set[int], timeout_s: float) -> int:
    """Rank 0's side, up to the verdict (the caller sends ACCEPTED): the rank id the peer proved, or
    HandshakeError saying why not. Reads at most HELLO + PROOF_BYTES bytes, within `timeout_s`."""
    conn.settimeout(timeout_s)
    try:
        magic, version, rank, nonce = HELLO.unpack(read_exactly(conn, HELLO.size))
    except TimeoutError:
        raise HandshakeError(f"no hello within {timeout_s:.0f} s") from None
    if magic != MAGIC:
        raise HandshakeError("not a tensor-parallel rank (no hello)")
    if version != VERSION:
        raise HandshakeError(f"protocol version {version}, expected {VERSION}")
    if rank not in expected:
        raise HandshakeError(f"unknown rank id {rank} (expected {sorted(expected)})")
    leader_nonce = secrets.token_bytes(NONCE_BYTES)
    conn.sendall(CHALLENGE.pack(leader_nonce, _proof(secret, b"rank0", rank, nonce, leader_nonce)))
    try:
        proof = read_exactly(conn, PROOF_BYTES)
    except TimeoutError:
        raise HandshakeError(f"rank {rank} sent no proof within {timeout_s:.0f} s") from None
    if not hmac.compare_digest(proof, _proof(secret, b"worker", rank, leader_nonce, nonce)):
        raise HandshakeError(f"rank {rank} failed authentication: wrong group secret")
    return rank
