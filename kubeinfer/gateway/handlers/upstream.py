"""How the proxy talks to engines: one pooled HTTP client, a timeout per phase, and which failures a
request may be retried after.

Sizing, from the burst that used to give 502s (issue #15): 600 streams arrived at once and the
gateway's event loop stalled for about 3 s, so a 2 s connect timeout, measured on that loop, fired on
connections the kernel had completed in microseconds (an empty ConnectTimeout, never retried). The
stall was httpcore's connection pool: on every request start and end it scans each of its
connections and queued requests (O(n) per event, O(n^2) per burst: 7 s of CPU for 600 streams in
one pool, profiled). So streams are spread over many small pools (`ClientShards`, at most
SHARD_STREAMS in flight each), timeouts are generous (one on a starved loop says more about the
gateway than about the engine), a connect failure of any kind is retried on another pod, and there
is no connection cap by default: every in-flight stream needs its own HTTP/1.1 connection, and the
engines do their own admission (429 when full).
Idle connections expire before the engine's keep-alive (uvicorn: 5 s) closes them, so a request is
not written onto a connection the server is closing ("Server disconnected without sending a response").

Every failure before the first byte of the response is retried on another pod: the engine aborts a
request whose connection closes, and generation has no side effects, so a second attempt cannot run
anything twice that matters. After the first byte the status is sent and nothing can be retried.
"""
from __future__ import annotations

from dataclasses import dataclass

import httpx

from ..datastore.http_client import make_client

SHARD_STREAMS = 16  # in-flight requests per pool: keeps httpcore's per-event scan short
# Engine answers that mean "not here, but maybe elsewhere": queue full, not ready or draining, and an
# adapter this pod does not hold (yet). Each sends the request to another pod while one is left.
RETRY_ELSEWHERE = {429, 503, 404}


@dataclass
class UpstreamConfig:
    connect_timeout: float = 10.0
    first_byte_timeout: float = 600.0  # engines queue requests: a long wait under load is normal
    idle_timeout: float = 300.0  # longest gap between two chunks of a response
    max_attempts: int = 3  # the pick and two other pods
    engine_api_key: str | None = None  # presented to engines in place of the client's Authorization


class ClientShards:
    """Many small httpx pools instead of one big one (see the module's docstring). `acquire` gives the
    client of a pool with room and a `release` to call when the response is closed."""

    def __init__(self, config: UpstreamConfig, client: httpx.AsyncClient | None = None) -> None:
        # read=None: the first byte and the gaps between chunks have their own limits (forward.py, relay.py).
        self.timeout = httpx.Timeout(connect=config.connect_timeout, read=None, write=config.idle_timeout,
                                     pool=config.first_byte_timeout)
        self.fixed = client  # tests hand in one client (a mock transport): no sharding then
        self._shards: list[list] = []  # [client, requests in flight]

    def acquire(self):
        if self.fixed is not None:
            return self.fixed, lambda: None
        shard = next((s for s in self._shards if s[1] < SHARD_STREAMS), None)
        if shard is None:
            shard = [make_client(self.timeout), 0]
            self._shards.append(shard)
        shard[1] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released, shard[1] = True, shard[1] - 1
        return shard[0], release

    async def aclose(self) -> None:
        for client, _ in self._shards:
            await client.aclose()
        if self.fixed is not None:
            await self.fixed.aclose()


class FirstByteTimeout(Exception):
    """The engine took the request but sent nothing back within --upstream-first-byte-timeout."""


def failure_status(errors: list[BaseException]) -> int:
    """The status for a request every attempt failed before a response: 503 (retry later: it never
    ran) when no pod could be reached, 504 when one held it past the first-byte timeout, else 502."""
    if any(isinstance(e, FirstByteTimeout) for e in errors):
        return 504
    if all(isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)) for e in errors):
        return 503
    return 502


def retry_reason(error: BaseException | None = None, status: int | None = None) -> str:
    """A bounded label value for kubeinfer_gateway_retries_total."""
    if status is not None:
        return f"status_{status}"
    if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
        return "connect"
    if isinstance(error, FirstByteTimeout):
        return "first_byte_timeout"
    return "transport"
