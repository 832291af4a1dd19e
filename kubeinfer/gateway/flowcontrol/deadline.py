"""Time budgets: a request may carry `x-request-timeout-ms`, the milliseconds its client will wait.

The gateway spends part of it (holding, queueing) and never more: a request whose wait in the fair
queue would, by the queue's recent dispatch rate, exceed what is left is refused at once (429 with
Retry-After: when the queue should have room), one whose budget runs out while waiting gets a 503 with
Retry-After; either way before an engine did any work. What is left is forwarded to the engine in the
same header, so the engine can end the request when it is spent.
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping

from ..scheduling.picker import RoutingError

TIMEOUT_HEADER = "x-request-timeout-ms"
MAX_TIMEOUT_MS = 24 * 3600 * 1000  # a day, as the engines allow


def deadline_of(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """The monotonic time the budget ends; None without the header; RoutingError(400) when invalid."""
    value = headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    text = value.strip()
    # Digits only, and few of them: int() of 400 digits works, but as seconds it overflows a float (a 500).
    milliseconds = int(text) if text.isascii() and text.isdigit() and len(text) <= 12 else 0
    if not 0 < milliseconds <= MAX_TIMEOUT_MS:
        raise RoutingError(400, f"{TIMEOUT_HEADER} must be a positive integer of milliseconds, at most "
                                f"{MAX_TIMEOUT_MS}, got {value[:32]!r}")
    return (time.monotonic() if now is None else now) + milliseconds / 1000.0


def remaining_seconds(deadline: float | None, now: float | None = None) -> float | None:
    return None if deadline is None else deadline - (time.monotonic() if now is None else now)


def remaining_ms_header(deadline: float | None) -> str | None:
    """The header value to forward: what is left, at least 1 ms (the engine then ends it at once)."""
    left = remaining_seconds(deadline)
    return None if left is None else str(max(1, math.floor(left * 1000)))
