"""Bounds on what one HTTP request may cost a server before any handler runs, shared by the engine's API
and the gateway's proxy: a body size limit, a time limit on reading the body, and a limit on requests in
flight. (The time limit on the request head is the connection's: http_server.py.)

The body is read here, whole, before the application sees it: a Content-Length over the limit is refused
before a byte of the body is read, and a chunked body is counted as it comes and refused the moment it
passes the limit, so memory per request stays bounded by the limit. Refusals use OpenAI's error shape:
413 (too large), 408 (the body did not arrive in time), 503 with Retry-After (too many in flight).
Probe and scrape paths (`exempt`) are never counted nor refused for concurrency: a busy pod must
still answer its probes.
"""
from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 16 << 20  # a full 128k-token context as text or token ids fits many times over
DEFAULT_BODY_READ_TIMEOUT = 60.0
DEFAULT_HEADER_READ_TIMEOUT = 10.0
ERROR_TYPES = {408: "RequestTimeoutError", 413: "RequestTooLargeError", 503: "ServiceUnavailableError"}
# Error messages quote what the client sent (a field name, a type, a model name): quoted words are cut short and
# the whole message bounded, so that an error never echoes megabytes of the body back (or into a proxy's log).
MAX_MESSAGE_CHARS, QUOTED_WORD_CHARS = 1000, 64
_LONG_WORD = re.compile(r"\S{200,}")


@dataclass(frozen=True)
class GuardConfig:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_read_timeout: float = DEFAULT_BODY_READ_TIMEOUT  # seconds for the whole body, from its first read
    max_concurrent_requests: int | None = None  # None: unlimited
    exempt: frozenset[str] = frozenset({"/health", "/metrics", "/version", "/load"})


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def bounded_message(message: str) -> str:
    """`message` with every run of 200 or more non-blank characters cut to its first 64, and at most 1,000 long."""
    return clip(_LONG_WORD.sub(lambda word: clip(word.group(), QUOTED_WORD_CHARS), message), MAX_MESSAGE_CHARS)


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"), "param": param,
                                 "code": status}}).encode()


async def send_error(send, status: int, message: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = error_body(status, message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyTooLarge(Exception):
    pass


class RequestGuard:
    """ASGI middleware: refuses what exceeds GuardConfig before the wrapped application runs."""

    def __init__(self, app, config: GuardConfig) -> None:
        self.app, self.config = app, config
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counted = scope["path"] not in self.config.exempt and self.config.max_concurrent_requests is not None
        if counted and self.in_flight >= self.config.max_concurrent_requests:
            return await send_error(send, 503, f"this server has {self.in_flight} requests in flight, its limit; "
                                               "retry shortly", [(b"retry-after", b"1")])
        self.in_flight += counted
        try:
            await self._guarded(scope, receive, send)
        finally:
            self.in_flight -= counted

    async def _guarded(self, scope, receive, send) -> None:
        limit = self.config.max_body_bytes
        length = _content_length(scope)
        if length is not None and length > limit:
            return await send_error(send, 413, _too_large(limit, f"Content-Length {length}"))
        try:
            async with asyncio.timeout(self.config.body_read_timeout):
                body, disconnected = await _read_body(receive, limit)
        except BodyTooLarge:
            return await send_error(send, 413, _too_large(limit, "the body sent"))
        except TimeoutError:
            return await send_error(send, 408, f"the request body did not arrive within "
                                               f"{self.config.body_read_timeout:g} s")
        if disconnected:
            return None
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when the client leaves

        await self.app(scope, replay, send)


def _too_large(limit: int, what: str) -> str:
    return f"request body too large: {what} is over this server's limit of {limit} bytes"


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _read_body(receive, limit: int) -> tuple[bytes, bool]:
    """(the body, whether the client left first); BodyTooLarge as soon as the count passes `limit`."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", True
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False


def add_http_limit_arguments(parser, max_concurrent_requests: int) -> None:
    """The same flags on `kubeinfer serve` and `kubeinfer gateway`."""
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies get 413, refused by Content-Length or as they are counted")
    parser.add_argument("--header-read-timeout", type=float, default=DEFAULT_HEADER_READ_TIMEOUT,
                        help="seconds a connection may take to send a request's head before it is closed")
    parser.add_argument("--body-read-timeout", type=float, default=DEFAULT_BODY_READ_TIMEOUT,
                        help="seconds a request's whole body may take to arrive before a 408")
    parser.add_argument("--max-concurrent-requests", type=int, default=max_concurrent_requests,
                        help="requests in flight (streams included) beyond which new ones get 503 with Retry-After; "
                             "probes and /metrics are never refused (0: no limit)")


def guard_from_args(args) -> GuardConfig:
    return GuardConfig(max_body_bytes=args.max_request_body_bytes, body_read_timeout=args.body_read_timeout,
                       max_concurrent_requests=args.max_concurrent_requests or None)
