"""Rank 0's hand-off of one decode step to a rank, alone: the tensor-parallel channel's schema (check, encode,
one sendall on a socket with a timeout, as step_channel.StepSender) against the pickle it replaced (the
peer: dumps and one sendall on a blocking socket), each to a reader thread over a loopback socket pair,
in alternating rounds so that a loaded machine weighs on both alike.

    python benchmarks/bench_tp_step_send.py
"""
import pickle
import socket
import statistics
import struct
import threading
import time

from kubeinfer.engine.core.tp_messages import check_message
from kubeinfer.engine.distributed import wire
from kubeinfer.engine.model_executor.step_inputs import StepInputs

H = struct.Struct("!Q")


def drain(conn: socket.socket) -> None:
    while conn.recv(1 << 20):
        pass


def step(n: int) -> tuple:
    """A decode step of `n` sequences, as rank 0 sends it."""
    inp = StepInputs()
    for i in range(n):
        inp.add([7], 200 + i, list(range(i * 16, i * 16 + 15)), 16)
        inp.logits_indices.append(i)
    inp.num_decodes = n
    return ("step", inp, None)


def old(conn: socket.socket, msg: tuple) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    conn.sendall(H.pack(len(data)) + data)


def new(conn: socket.socket, msg: tuple) -> None:
    body = wire.encode(check_message(msg))
    conn.sendall(H.pack(len(body)) + body)


def main() -> None:
    for n in (1, 32):
        msg = step(n)
        a, b = socket.socketpair()
        c, d = socket.socketpair()
        c.settimeout(60)
        for reader in (b, d):
            threading.Thread(target=drain, args=(reader,), daemon=True).start()
        res = {"pickle": [], "schema": []}
        for _ in range(7):
            for name, send, conn in (("pickle", old, a), ("schema", new, c)):
                times = []
                for _ in range(2000):
                    start = time.perf_counter()
                    send(conn, msg)
                    times.append(time.perf_counter() - start)
                res[name].append(statistics.median(times) * 1e6)
        print(f"batch {n}: pickle {statistics.median(res['pickle']):.1f} us, schema "
              f"{statistics.median(res['schema']):.1f} us (median of 7 rounds x 2000 sends)")


if __name__ == "__main__":
    main()
