"""Notice, on rank 0, that another rank is gone: its connection closes when its process ends (killed,
crashed, out of memory), whatever node it runs on. A rank that hangs instead is caught by the
collectives' timeout (--distributed-timeout) in the next step. Either way the engine dies: ranks that
missed a step are out of step with the others, and only a restart of the whole group mends that."""
from __future__ import annotations

import logging
import selectors
import socket
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)
_DRAIN_BYTES = 4096


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
        selector = selectors.DefaultSelector()
        for rank, conn in self._connections.items():
            selector.register(conn, selectors.EVENT_READ, rank)
        warned: set[int] = set()
        with selector:
            while not self._stopping.is_set():
                try:
                    ready = selector.select(0.5)
                except (OSError, ValueError):  # closed under us: shutting down
                    return
                for key, _ in ready:
                    rank = key.data
                    try:
                        # Consumed, not peeked: a worker never sends after its handshake, and bytes left in the
                        # buffer would keep the socket readable and this loop spinning.
                        data = key.fileobj.recv(_DRAIN_BYTES)
                    except (BlockingIOError, InterruptedError, TimeoutError):
                        continue
                    except OSError:
                        data = b""
                    if data:
                        if rank not in warned:
                            warned.add(rank)
                            logger.warning("tensor-parallel rank %d sent data it should not (ignored)", rank)
                        continue
                    if self._stopping.is_set():
                        return
                    self.fail(f"tensor-parallel rank {rank} is gone ({self._describe(rank)})")
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
