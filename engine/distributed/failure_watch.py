"""Notice, on rank 0, that another rank is gone: its connection closes when its process ends (killed,
crashed, out of memory), whatever node it runs on. A rank that hangs instead is caught by the
collectives' timeout (--distributed-timeout) in the next step. Either way the engine dies: ranks that
missed a step are out of step with the others, and only a restart of the whole group mends that."""
from __future__ import annotations

import logging
import select
import socket
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class RankFailedError(RuntimeError):
    """A tensor-parallel step cannot complete: a rank died, hung, or raised."""
    unrecoverable = True  # core/errors.is_unrecoverable: the engine dies, the pod restarts


class FailureWatch:
    def __init__(self, connections: dict[int, socket.socket], describe: Callable[[int], str]) -> None:
        """`describe(rank)`: what is known about a rank's end (its exit code, when it was our child)."""
        self._connections = connections
        self._describe = describe
        self.reason: str | None = None
        self.failed = threading.Event()  # set with `reason`
        self.on_failure: list[Callable[[str], None]] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tp-failure-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """A clean shutdown: connections closing from now on are expected."""
        self._stopping.set()

    def _watch(self) -> None:
        by_socket = {conn: rank for rank, conn in self._connections.items()}
        while not self._stopping.is_set():
            try:
                readable, _, _ = select.select(list(by_socket), [], [], 0.5)
            except (OSError, ValueError):  # closed under us: shutting down
                return
            for conn in readable:
                try:
                    data = conn.recv(1, socket.MSG_PEEK)
                except OSError:
                    data = b""
                if data or self._stopping.is_set():
                    continue
                self.fail(f"tensor-parallel rank {by_socket[conn]} is gone ({self._describe(by_socket[conn])})")
                return

    def fail(self, reason: str) -> None:
        if self.reason is not None:
            return
        self.reason = reason
        self.failed.set()
        logger.critical("%s", reason)
        for callback in self.on_failure:
            try:
                callback(reason)
            except Exception:
                logger.exception("failure callback failed")
