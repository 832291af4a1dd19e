"""Reads an engine's state over one kept-alive connection per engine, with the HTTP/1.1 exchange
written out by hand: its compact load report (`GET /load`, kubeinfer/engine/entrypoints/load_report.py), or, for
engines without one (vLLM), `GET /health` and `GET /metrics` (metrics_text.py reads the latter).

Why by hand: the gateway polls every engine several times a second, and a general client's request
costs hundreds of microseconds of the event loop that also routes (httpx: about 0.3 ms; with
Prometheus text parsing, 1.6 ms per scrape). These exchanges are always the same GET and an answer
with a Content-Length or chunked, so each takes tens of microseconds (benchmarks/bench_routing.py).
"""
from __future__ import annotations

import asyncio
import json

from .endpoints import EngineState

MAX_BODY = 64 << 20  # an exposition larger than this is not an engine's


class LoadReportUnsupported(Exception):
    """The engine has no /load (e.g. a vLLM engine): read /health and /metrics instead."""


class KeptAliveConnection:
    """GETs on one connection, re-opened when the server closed it while idle; `authorization` (the
    engines' key, engine_auth.py) goes with every request."""

    def __init__(self, host: str, port: int, authorization: str | None = None) -> None:
        self.host, self.port = host, port
        self._auth = f"Authorization: {authorization}\r\n" if authorization else ""
        self._requests: dict[str, bytes] = {}
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> tuple[int, bytes]:
        """(status, body); raises on a failed exchange (the connection is then closed)."""
        reused = self._writer is not None and not self._writer.is_closing()
        try:
            return await self._exchange(path)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.close()
            if not reused:
                raise
            return await self._exchange(path)  # the server closed an idle connection: once more, fresh
        except BaseException:
            self.close()  # a timeout mid-exchange leaves the stream out of step
            raise

    def _request(self, path: str) -> bytes:
        request = self._requests.get(path)
        if request is None:
            request = self._requests[path] = (f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                                              f"Accept: */*\r\n{self._auth}\r\n").encode()
        return request

    async def _exchange(self, path: str) -> tuple[int, bytes]:
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._writer.write(self._request(path))
        head = await self._reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length, chunked, closing = 0, False, False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                closing = value.strip().lower() == b"close"
        if length > MAX_BODY:
            raise ValueError(f"{path} answered {length} bytes")
        body = await (self._chunks() if chunked else self._reader.readexactly(length))
        if closing:
            self.close()
        return status, body

    async def _chunks(self) -> bytes:
        parts, total = [], 0
        while True:
            size = int((await self._reader.readuntil(b"\r\n")).split(b";")[0], 16)
            total += size
            if total > MAX_BODY:
                raise ValueError(f"a chunked body over {MAX_BODY} bytes")
            if size == 0:  # the last chunk: trailers (if any), then an empty line
                while (await self._reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                return b"".join(parts)
            parts.append((await self._reader.readexactly(size + 2))[:-2])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


class LoadConnection(KeptAliveConnection):
    async def read(self) -> tuple[EngineState, dict]:
        """(load, the whole report); raises on failure or a not-ready engine (503)."""
        status, body = await self.get("/load")
        if status == 503:
            raise RuntimeError("/load answered 503: the engine is not ready")
        if status == 401:  # not a missing report: a missing or wrong key, which the operator must fix
            raise RuntimeError("/load answered 401: the engine wants the key of --engine-api-key")
        try:
            report = json.loads(body)
            return EngineState(waiting=report["waiting"], running=report["running"], kv_usage=report["kv_usage"],
                               running_adapters=frozenset(report["running_adapters"]),
                               waiting_adapters=frozenset(report["waiting_adapters"]),
                               max_loras=report["max_loras"], max_running=report.get("max_num_seqs", 0),
                               load_report=True, kv_events=_kv_events(report.get("kv_events"))), report
        except (ValueError, KeyError, TypeError):  # 404, or some other /load: not our engine's report
            raise LoadReportUnsupported(f"{self.host}:{self.port} has no load report (/load: {status})") from None


def _kv_events(value) -> dict | None:
    """The report's `kv_events` when it names an events endpoint; anything else means none."""
    return value if isinstance(value, dict) and isinstance(value.get("endpoint"), str) else None
