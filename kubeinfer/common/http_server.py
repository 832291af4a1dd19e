"""The uvicorn server of the engine's API and of the gateway's proxy, with the limits an open port needs.

uvicorn closes idle keep-alive connections, but a connection that sends half a request head and then
nothing is held forever (slowloris): `HeadTimeoutProtocol` closes any connection whose request head is
not complete within `header_read_timeout` of its first byte (or of the connection opening). The body's
own time limit, its size and the requests in flight are bounded by http_guard.RequestGuard, which each
server puts in front of its application.
"""
from __future__ import annotations

import asyncio
from functools import partial

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .http_guard import DEFAULT_HEADER_READ_TIMEOUT


class HeadTimeoutProtocol(H11Protocol):
    """h11 protocol that closes a connection whose request head takes longer than `header_read_timeout`."""

    def __init__(self, *args, header_read_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_read_timeout = header_read_timeout
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and data:  # part of a head: it must complete in time
            if self._head_timer is None:
                self._arm()
        else:
            self._disarm()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_read_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def server_config(app, header_read_timeout: float = DEFAULT_HEADER_READ_TIMEOUT, **kwargs) -> uvicorn.Config:
    """A uvicorn Config serving `app` on the head-timeout h11 protocol."""
    protocol = partial(HeadTimeoutProtocol, header_read_timeout=header_read_timeout)
    return uvicorn.Config(app, http=protocol, **kwargs)
