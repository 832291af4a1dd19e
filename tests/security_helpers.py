"""Raw-socket clients for the request-path security tests (issue #34): half-sent requests, oversized
bodies sent chunk by chunk, and the memory a server takes while it refuses them."""
from __future__ import annotations

import json
import socket
import time
import tracemalloc
from contextlib import contextmanager


def half_sent_head(port: int) -> socket.socket:
    """A connection that sends part of a request head and then nothing (slowloris)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    return sock


def half_sent_body(port: int, path: str = "/v1/completions", headers: str = "") -> socket.socket:
    """A connection that sends a whole head announcing 1000 bytes of body, then 10 of them."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
                 "Content-Length: 1000\r\n\r\n{\"model\":".encode())
    return sock


def closed_or_answered(sock: socket.socket, within: float) -> bytes | None:
    """What the server sent before closing (b"" when it closed without a word); None if still open."""
    sock.settimeout(within)
    received = b""
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                return received
            received += data
    except (ConnectionResetError, BrokenPipeError):
        return received
    except TimeoutError:
        return None if not received else received
    return received if received else None


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def json_of(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


def send_chunked_until_refused(port: int, total: int, path: str = "/v1/completions", chunk: int = 64 << 10,
                               headers: str = "") -> bytes:
    """Streams `total` bytes of chunked body (no Content-Length) and returns the server's answer."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
                 "Transfer-Encoding: chunked\r\n\r\n".encode())
    piece = f"{chunk:x}\r\n".encode() + b"x" * chunk + b"\r\n"
    sent = 0
    try:
        while sent < total:
            sock.sendall(piece)
            sent += chunk
        sock.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused mid-body: the answer is already waiting
    answer = closed_or_answered(sock, 10.0) or b""
    sock.close()
    return answer


def announce_huge_body(port: int, length: int, path: str = "/v1/completions", headers: str = "") -> bytes:
    """Sends only a head whose Content-Length is `length`; returns the answer (before any body)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
                 f"Content-Length: {length}\r\n\r\n".encode())
    answer = closed_or_answered(sock, 10.0) or b""
    sock.close()
    return answer


@contextmanager
def traced_peak():
    """Yields a dict whose 'peak' is the bytes Python allocated at most above the start, all threads."""
    result = {}
    tracemalloc.start()
    start, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    try:
        yield result
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        result["peak"] = peak - start
