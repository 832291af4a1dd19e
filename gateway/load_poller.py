"""Reads an engine's compact load report (`GET /load`, engine/entrypoints/load_report.py) over one
kept-alive connection per engine, with the HTTP/1.1 exchange written out by hand.

Why by hand: the gateway polls every engine several times a second, and a general client's request
costs hundreds of microseconds of the event loop that also routes (httpx: about 0.3 ms; with
Prometheus text parsing, 1.6 ms per scrape). This exchange is always the same request and an answer
with a Content-Length, so it takes tens of microseconds (benchmarks/bench_routing.py measures it).
"""
from __future__ import annotations

import asyncio
import json

from .endpoints import EngineState


class LoadReportUnsupported(Exception):
    """The engine has no /load (e.g. a vLLM engine): read /health and /metrics instead."""


class LoadConnection:
    def __init__(self, host: str, port: int, authorization: str | None = None) -> None:
        self.host, self.port = host, port
        auth = f"Authorization: {authorization}\r\n" if authorization else ""  # the engines' key (engine_auth.py)
        self.request = (f"GET /load HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: application/json\r\n{auth}"
                        "\r\n").encode()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def read(self) -> tuple[EngineState, dict]:
        """(load, the whole report); raises on failure or a not-ready engine (503)."""
        reused = self._writer is not None and not self._writer.is_closing()
        try:
            status, body = await self._exchange()
        except (ConnectionError, asyncio.IncompleteReadError):
            self.close()
            if not reused:
                raise
            status, body = await self._exchange()  # the server closed an idle connection: once more, fresh
        except BaseException:
            self.close()  # a timeout mid-exchange leaves the stream out of step
            raise
        if status == 503:
            raise RuntimeError("/load answered 503: the engine is not ready")
        if status == 401:  # not a missing report: a missing or wrong key, which the operator must fix
            raise RuntimeError("/load answered 401: the engine wants the key of --engine-api-key")
        try:
            report = json.loads(body)
            return EngineState(waiting=report["waiting"], running=report["running"], kv_usage=report["kv_usage"],
                               running_adapters=frozenset(report["running_adapters"]),
                               waiting_adapters=frozenset(report["waiting_adapters"]),
                               max_loras=report["max_loras"], max_running=report.get("max_num_seqs", 0)), report
        except (ValueError, KeyError, TypeError):  # 404, or some other /load: not our engine's report
            raise LoadReportUnsupported(f"{self.host}:{self.port} has no load report (/load: {status})") from None

    async def _exchange(self) -> tuple[int, bytes]:
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._writer.write(self.request)
        head = await self._reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length, closing = 0, False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
            elif name.strip().lower() == b"connection":
                closing = value.strip().lower() == b"close"
        body = await self._reader.readexactly(length)
        if closing:
            self.close()
        return status, body

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
