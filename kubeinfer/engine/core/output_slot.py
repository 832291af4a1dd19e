"""Where the engine thread leaves a request's outputs for the asyncio task that streams them.

Outputs are cumulative (each holds all text and tokens so far), so only the latest matters: a slot
holds one, and a new one replaces it. A reader that falls behind skips intermediate states instead of
queueing them, so a stalled client costs neither memory nor engine time (vLLM's output collector
does the same). The engine thread schedules at most one wake-up per slot at a time.
"""
from __future__ import annotations

import asyncio
import threading

from .outputs import RequestOutput


class OutputSlot:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._wake_pending = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Engine thread: the newest output (replacing one not yet read), or an error that ends the stream."""
        with self._lock:
            if isinstance(item, BaseException):
                self._error = self._error or item
            else:
                self._latest = item
            if self._wake_pending:
                return
            self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the reader's loop is closed: nobody is left to read
            pass

    def fail(self, error: BaseException) -> None:
        self.put(error)

    def _wake(self) -> None:
        with self._lock:
            self._wake_pending = False
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The newest output not read yet, waiting for one; raises the error that ended the stream."""
        while True:
            with self._lock:
                item, self._latest = self._latest, None
                if item is None and self._error is not None:
                    raise self._error
                if item is not None:
                    return item
                self._ready.clear()
            await self._ready.wait()
