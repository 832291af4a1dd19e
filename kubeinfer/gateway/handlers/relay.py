"""Relaying the engine's response that won (forward.py) to the client: its headers without hop-by-hop ones,
its body chunk by chunk with a bound on the gap between chunks, and its end, however it comes (complete, the
engine failing or going silent, the client leaving), reported to the picker, the metrics and the request's
ticket."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import httpx
from fastapi.responses import Response, StreamingResponse

from ..datastore.endpoints import Endpoint
from ..datastore.http_client import describe
from .extproc import error_body
from .usage_strip import UsageEventStripper

logger = logging.getLogger(__name__)
HOP_BY_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate"}
# Set by the gateway's own HTTP server on every response: the engine's copies would make each appear twice.
SERVER_SET = {"date", "server"}
CLIENT_CLOSED = 499  # nginx's convention; nobody receives it, the client is gone


def relayed_headers(headers: httpx.Headers) -> dict[str, str]:
    """An engine's response headers as the client gets them: without hop-by-hop ones (those the standard
    names and those its `Connection` header names) and without the ones the gateway's server sets."""
    named = {h.strip().lower() for h in headers.get("connection", "").split(",") if h.strip()}
    dropped = HOP_BY_HOP | SERVER_SET | named
    out: dict[str, str] = {}
    for key, value in headers.multi_items():
        if key.lower() not in dropped:
            out[key] = f"{out[key]}, {value}" if key in out else value  # repeated headers folded into one
    return out


def relay_response(response: httpx.Response, endpoint: Endpoint, sent: float, model: str, start: float,
                   release: Callable[[], None], ticket, idle_timeout: float, metrics) -> Response:
    """The client's response: the engine's, streamed as it comes (`ticket`, the request's flow-control ticket,
    sees it pass). However it ends, the engine's load is given back at once, the connection released and the
    outcome counted (duration, a 502 mid-response, or a cancellation); then the ticket is settled."""
    relay = Relay(response, idle_timeout, observe=ticket.feed if ticket is not None else None,
                  strip_usage=ticket is not None and ticket.request.add_usage)
    if ticket is not None:
        ticket.response_began(response.status_code)

    async def finish() -> None:
        endpoint.record_finish(sent)  # the request no longer loads the engine: the picker knows at once
        await response.aclose()
        release()
        if relay.completed:
            metrics.duration.labels(model).observe(time.perf_counter() - start)
        elif relay.error is not None:
            metrics.errors.labels(model, "502").inc()
            logger.warning("endpoint %s failed mid-response: %s", endpoint.address, describe(relay.error))
        else:
            metrics.cancelled.labels(model).inc()
        if ticket is not None:
            ticket.finish(response.status_code if relay.completed else 502 if relay.error else CLIENT_CLOSED)

    out_headers = relayed_headers(response.headers)
    out_headers["x-gateway-destination-endpoint"] = endpoint.address
    return UpstreamStream(relay, response.status_code, out_headers, finish)


class Relay:
    """The upstream body, chunk by chunk, with a bound on the gap between chunks. It records how it
    ended: `completed`, `error` (the engine failed or went silent), or neither (the client left)."""

    def __init__(self, upstream: httpx.Response, idle_timeout: float, observe=None, strip_usage: bool = False) -> None:
        self.upstream, self.idle_timeout = upstream, idle_timeout
        self.observe = observe  # sees each chunk as it passes (usage accounting)
        self.completed, self.error = False, None
        self.sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        self.stripper = UsageEventStripper() if strip_usage and self.sse else None  # usage the gateway asked for

    async def chunks(self):
        iterator = self.upstream.aiter_raw().__aiter__()
        while True:
            try:
                async with asyncio.timeout(self.idle_timeout):
                    chunk = await anext(iterator)
            except StopAsyncIteration:
                self.completed = True
                if self.stripper is not None and (tail := self.stripper.flush()):
                    yield tail
                return
            except (httpx.HTTPError, TimeoutError) as error:
                self.error = error if not isinstance(error, TimeoutError) else TimeoutError(
                    f"no data for {self.idle_timeout:g} s")
                if not self.sse:
                    raise  # the client's connection is cut: a truncated body must not look complete
                # A stream ends with an error event (vLLM's convention; the openai client raises on it).
                yield f"data: {json.dumps(error_body(502, f'engine failed mid-stream: {describe(self.error)}'))}\n\n"
                return
            if self.observe is not None:
                self.observe(chunk)
            yield chunk if self.stripper is None else self.stripper.feed(chunk)


class UpstreamStream(StreamingResponse):
    """Relays an upstream response; `on_close` runs however the relay ends (done, error or client gone),
    so the upstream stream is closed at once and the engine aborts the request."""

    def __init__(self, relay: Relay, status: int, headers: dict[str, str], on_close) -> None:
        super().__init__(relay.chunks(), status_code=status, headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()
