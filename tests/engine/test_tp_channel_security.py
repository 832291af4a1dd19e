"""The tensor-parallel step channel as a closed group (issue #44, finding 2), on loopback without a model:
only ranks that prove the group secret join, each id once, and an impostor does not keep the real rank out;
a worker takes only messages of the schema (a pickle payload is refused, never run); a rank that stops reading
fails the send within --distributed-timeout; a stray byte does not make the failure watch spin; rank 0's
rendezvous listens only on the master address. The schema's round trips are in test_tp_wire.py."""
from __future__ import annotations

import logging
import os
import pickle
import secrets
import socket
import struct
import threading
import time

import pytest
import torch

from kubeinfer.engine.core.tensor_parallel import TensorParallelGroup
from kubeinfer.engine.core.tp_messages import check_message
from kubeinfer.engine.distributed import group_auth, step_channel, wire
from kubeinfer.engine.distributed.failure_watch import FailureWatch, RankFailedError
from kubeinfer.engine.distributed.group_auth import HELLO, MAGIC, HandshakeError
from kubeinfer.engine.distributed.step_channel import StepReceiver, StepSender
from kubeinfer.engine.lora.adapter import LoRAAdapter, LoRAWeights

SECRET = secrets.token_bytes(32)


class Rank0:
    """A StepSender accepting `ranks` on a thread, as TensorParallelGroup does."""

    def __init__(self, ranks: list[int], timeout_s: float = 20, secret: bytes = SECRET) -> None:
        self.sender = StepSender("127.0.0.1", 0, secret)
        self.port, self.error = self.sender.port, None
        self.thread = threading.Thread(target=self._accept, args=(ranks, timeout_s), daemon=True)
        self.thread.start()

    def _accept(self, ranks, timeout_s):
        try:
            self.sender.accept(ranks, timeout_s)
        except Exception as error:
            self.error = error

    def joined(self, timeout_s: float = 20) -> dict[int, socket.socket]:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive() and self.error is None, self.error
        return self.sender.connections


def receive_in_thread(port: int, rank: int, secret: bytes = SECRET, timeout_s: float = 20) -> dict:
    """A worker joining on a thread; the dict gets its receiver or its error."""
    out: dict = {}

    def join():
        try:
            out["receiver"] = StepReceiver("127.0.0.1", port, rank, timeout_s, secret)
        except Exception as error:
            out["error"] = error
    out["thread"] = threading.Thread(target=join, daemon=True)
    out["thread"].start()
    return out


def impostor_hello(port: int, rank: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.sendall(HELLO.pack(MAGIC, wire.VERSION, rank, os.urandom(32)))
    return conn


def closed_by_peer(conn: socket.socket, most: int = 1 << 16) -> bytes:
    """Everything the peer sent before closing (it must close within the socket's timeout)."""
    data = b""
    while chunk := conn.recv(most):
        data += chunk
    return data


def test_an_unknown_rank_id_is_refused_and_the_real_rank_still_joins(caplog, monkeypatch):
    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(step_channel, "HANDSHAKE_TIMEOUT_S", 2.0)
    rank0 = Rank0([1])
    old_style = socket.create_connection(("127.0.0.1", rank0.port), timeout=10)
    old_style.sendall(struct.pack("!Q", 1))  # the old protocol's whole handshake: an 8-byte rank id
    unknown = impostor_hello(rank0.port, 7)
    assert closed_by_peer(unknown) == b""  # nothing, not even a challenge
    worker = receive_in_thread(rank0.port, 1)
    assert set(rank0.joined()) == {1}
    worker["thread"].join(10)
    rank0.sender.send(("stop",))
    assert worker["receiver"].recv() == ("stop",)
    assert "unknown rank id 7" in caplog.text
    old_style.settimeout(10)  # its handshake thread times out on the 41-byte hello it never gets
    assert closed_by_peer(old_style) == b""
    rank0.sender.close()


def test_a_duplicate_id_is_refused_and_does_not_shut_out_the_real_rank(caplog):
    caplog.set_level(logging.WARNING)
    rank0 = Rank0([1, 2])
    first = receive_in_thread(rank0.port, 1)
    first["thread"].join(20)
    second = receive_in_thread(rank0.port, 1)  # holds the secret, but rank 1 has joined
    second["thread"].join(20)
    assert isinstance(second.get("error"), HandshakeError) and "refused rank 1" in str(second["error"])
    other = receive_in_thread(rank0.port, 2)
    assert set(rank0.joined()) == {1, 2}
    other["thread"].join(10)
    rank0.sender.send(("kv_cache", 8, None))
    assert first["receiver"].recv() == ("kv_cache", 8, None)
    assert other["receiver"].recv() == ("kv_cache", 8, None)
    assert "rank 1 has already joined (a duplicate id)" in caplog.text
    rank0.sender.close()


def test_a_wrong_secret_is_refused_both_ways(caplog):
    caplog.set_level(logging.WARNING)
    rank0 = Rank0([1])
    # A worker with another secret: rank 0's proof does not check out, so it sends nothing and leaves.
    stranger = receive_in_thread(rank0.port, 1, secret=b"x" * 32)
    stranger["thread"].join(20)
    assert isinstance(stranger.get("error"), HandshakeError)
    assert "is not this group's rank 0" in str(stranger["error"])
    # A peer that answers the challenge without the secret is refused by rank 0.
    guesser = impostor_hello(rank0.port, 1)
    group_auth.read_exactly(guesser, group_auth.CHALLENGE.size)
    guesser.sendall(os.urandom(group_auth.PROOF_BYTES))
    assert closed_by_peer(guesser) == b""
    worker = receive_in_thread(rank0.port, 1)
    assert set(rank0.joined()) == {1}
    worker["thread"].join(10)
    assert "receiver" in worker
    assert "rank 1 failed authentication: wrong group secret" in caplog.text
    rank0.sender.close()


def test_a_silent_connection_does_not_hold_the_accept_loop():
    rank0 = Rank0([1])
    silent = socket.create_connection(("127.0.0.1", rank0.port), timeout=10)  # says nothing, stays open
    time.sleep(0.2)
    start = time.monotonic()
    worker = receive_in_thread(rank0.port, 1)
    assert set(rank0.joined(timeout_s=5)) == {1}
    assert time.monotonic() - start < 5  # not after the silent one's handshake timeout
    worker["thread"].join(10)
    silent.close()
    rank0.sender.close()


def test_ranks_that_never_join_time_out_naming_them():
    rank0 = Rank0([1, 2], timeout_s=1)
    rank0.thread.join(10)
    assert isinstance(rank0.error, TimeoutError) and "[1, 2]" in str(rank0.error)


def test_a_pickle_payload_reaching_a_worker_is_refused_not_run(tmp_path):
    """Even from a peer that passed the handshake: a worker decodes only the schema."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    rank0 = Rank0([1])
    worker = receive_in_thread(rank0.port, 1)
    [conn] = rank0.joined().values()
    worker["thread"].join(10)
    for body in (pickle.dumps(("step", Payload())), bytes([wire.VERSION]) + pickle.dumps(Payload())):
        conn.sendall(struct.pack("!Q", len(body)) + body)
        with pytest.raises(wire.WireError):
            worker["receiver"].recv()
    assert not marker.exists()
    rank0.sender.close()


def test_a_frame_larger_than_the_bound_is_refused_before_any_allocation():
    rank0 = Rank0([1])
    worker = receive_in_thread(rank0.port, 1)
    [conn] = rank0.joined().values()
    worker["thread"].join(10)
    conn.sendall(struct.pack("!Q", 1 << 62))
    with pytest.raises(wire.WireError, match="a message of 4611686018427387904 bytes"):
        worker["receiver"].recv()
    rank0.sender.close()


def big_adapter(megabytes: int) -> LoRAAdapter:
    a = torch.zeros(megabytes * 256, 1024)  # 1 MB per 256 rows of float32
    return LoRAAdapter("big", 1, 1, 1.0, {(0, "q_proj"): LoRAWeights(a, torch.zeros(1, 1))})


def test_a_rank_that_never_reads_fails_the_send_within_the_timeout():
    rank0 = Rank0([1], timeout_s=1)
    worker = receive_in_thread(rank0.port, 1)  # joins, then never reads
    rank0.joined()
    worker["thread"].join(10)
    group = TensorParallelGroup.__new__(TensorParallelGroup)  # the group's send path around this channel
    group.sender, group.processes = rank0.sender, []
    group.watch = FailureWatch({}, lambda rank: "")
    message = ("lora", 0, big_adapter(4))
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 did not take its message within 1 s"):
        for _ in range(100):  # the socket buffers fill, then a send waits for a reader that never comes
            group.send(message)
    assert time.monotonic() - start < 10
    rank0.sender.close()


def test_a_stray_byte_does_not_make_the_watch_spin():
    leader, worker = socket.socketpair()
    watch = FailureWatch({1: leader}, lambda rank: "its connection closed")
    watch.start()
    try:
        worker.sendall(b"x")
        time.sleep(0.2)
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(1.0)
        spent = time.process_time() - cpu
        assert spent < 0.2 * (time.monotonic() - wall), f"the watch spun: {spent:.2f} CPU-s in 1 s"
        assert not watch.failed.is_set()
        worker.close()  # and a real end is still seen
        assert watch.failed.wait(5)
        assert watch.reason == "tensor-parallel rank 1 is gone (its connection closed)"
    finally:
        watch.stop()
        leader.close()


def listening_addresses(port: int) -> set[str]:
    """The local addresses listening on `port` (from /proc/net/tcp{,6}), e.g. {'127.0.0.1'}."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as lines:
            for line in list(lines)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    raw = bytes.fromhex(address)
                    if width == 8:
                        found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                    else:  # four host-order 32-bit words
                        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                        found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


def test_the_rendezvous_and_the_step_channel_listen_only_on_the_master_address():
    from kubeinfer.engine.distributed.parallel_state import destroy_group, init_group
    from kubeinfer.engine.distributed.step_channel import free_port

    port = free_port()
    init_group(0, 1, 0, "127.0.0.1", port, torch.device("cpu"), 10)
    try:
        assert listening_addresses(port) == {"127.0.0.1"}  # torch's own TCPStore binds every interface
    finally:
        destroy_group()
    sender = StepSender("127.0.0.1", 0, SECRET)
    assert listening_addresses(sender.port) == {"127.0.0.1"}
    sender.close()


def test_a_master_address_not_of_this_machine_falls_back_to_every_interface_and_says_so(monkeypatch, caplog):
    """192.0.2.1 (TEST-NET-1) is no local address: binding it fails without any traffic; the wildcard server
    that would follow is stubbed (tests never listen beyond loopback)."""
    from kubeinfer.engine.distributed import listen

    made = []
    monkeypatch.setattr(listen.socket, "create_server", lambda address, **kw: made.append(address) or "server")
    assert listen.listen_on("192.0.2.1", 29500) == "server"
    assert made == [("0.0.0.0", 29500)] and "not an address of this machine" in caplog.text
    def unknown(*_, **__):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(listen.socket, "getaddrinfo", unknown)  # no resolver asked
    with pytest.raises(OSError, match="'leader' does not resolve"):
        listen.listen_on("leader", 29500, resolve_s=0)


def test_a_multi_node_group_needs_its_secret(monkeypatch):
    monkeypatch.delenv(group_auth.SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="KUBEINFER_TP_SECRET is not set: set it to the same random value"):
        group_auth.group_secret(2)
    monkeypatch.setenv(group_auth.SECRET_ENV, "short")
    with pytest.raises(ValueError, match="has 5 characters"):
        group_auth.group_secret(2)
    monkeypatch.setenv(group_auth.SECRET_ENV, "s" * 64)
    assert group_auth.group_secret(2) == b"s" * 64
    one, other = group_auth.group_secret(1), group_auth.group_secret(1)  # one node: drawn afresh, not the env's
    assert len(one) == 32 and one != other != b"s" * 64


def test_the_secret_is_not_in_the_rank_plan_repr():
    from kubeinfer.engine.distributed.launch import RankPlan

    assert "secret" not in repr(RankPlan(1, 1, 2, "127.0.0.1", 1, 2, SECRET))


def test_messages_outside_the_table_are_refused_before_sending():
    for bad in [("step",), ("exec", "rm -rf /"), ["stop"], ("graphs", 8, "yes"), ("kv_cache", 1.5, None), ()]:
        with pytest.raises(wire.WireError):
            check_message(bad)
