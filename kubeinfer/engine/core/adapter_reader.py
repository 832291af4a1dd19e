"""Reads LoRA adapter files off the engine thread.

An adapter registered long ago may have left host memory (beyond `max_cpu_loras`); serving its next
request means reading its files again, which can take seconds, and a read on the engine loop would
stall every running stream. The scheduler passes such a request over and asks this reader; the read
runs on its own thread and its result goes back to the loop (`post`), which adds the adapter to the
pool, or fails the adapter's waiting requests with the read's error.
"""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from ..lora.manager import LoRAManager
from ..lora.pool import LoRAPoolError


class AdapterReader:
    def __init__(self, lora: LoRAManager, post: Callable[[tuple], None]) -> None:
        self.lora = lora
        self._post = post  # hands (lora_id, adapter or None, error or None) to the engine thread
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="adapter-reader")
        self._reading: set[int] = set()

    def start(self, lora_id: int) -> bool:
        """Engine thread: begin reading a registered adapter (once); False if there is nothing to read."""
        request = self.lora.registered.get(lora_id) or self.lora.retiring.get(lora_id)
        if request is None:
            return False
        if lora_id not in self._reading:
            self._reading.add(lora_id)

            def read() -> None:
                try:
                    result = (lora_id, self.lora.read(request), None)
                except Exception as error:  # noqa: BLE001 - handed to the loop, which fails its requests
                    result = (lora_id, None, error)
                self._post(result)

            self._pool.submit(read)
        return True

    def finish(self, lora_id: int, adapter, error: Exception | None) -> Exception | None:
        """Engine thread: put a read adapter in the pool; the read's error, if it failed."""
        self._reading.discard(lora_id)
        if error is not None:
            return error
        try:
            self.lora.pool.add(adapter)
        except LoRAPoolError:  # the host cache filled with pinned adapters meanwhile: read again later
            pass
        return None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
