"""The HTTP client every engine connection is made with: the scraper's polls and the proxy's streams.
No keep-alive cap, and idle connections expire before the engines' own keep-alive (uvicorn: 5 s) closes
them, so a request is not written onto a connection the server is closing."""
from __future__ import annotations

import ssl

import httpx

KEEPALIVE_EXPIRY = 2.0  # seconds; below the engines' (uvicorn's default 5 s) keep-alive timeout

_TLS = None


def make_client(timeout: httpx.Timeout | float) -> httpx.AsyncClient:
    """A client with no keep-alive cap and short idle expiry; all share one TLS context (building one
    per client costs milliseconds, and there may be one per engine pod)."""
    global _TLS
    _TLS = _TLS or ssl.create_default_context()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None,
                          keepalive_expiry=KEEPALIVE_EXPIRY)
    return httpx.AsyncClient(timeout=timeout, limits=limits, verify=_TLS)


def describe(error: BaseException) -> str:
    """The cause, always with its type: httpx's timeouts and resets often have an empty message."""
    detail = str(error) or str(error.__cause__ or "") or "no detail"
    return f"{type(error).__name__}: {detail}"
