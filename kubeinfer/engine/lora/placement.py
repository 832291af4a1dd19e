"""Keeps the adapters an engine serves equal to the placement the operator chose for its pod.

The operator writes the pod annotation `serving.kubeinfer.io/adapters: "a,b"`; a downward-API volume
projects it into a file, which the kubelet rewrites when the annotation changes. This watcher polls the
file and loads `CATALOG/NAME` for each listed adapter, unloading those it loaded that are no longer
listed (requests in flight on them finish first). Adapters from --lora-modules or the load route are
not its business. An adapter that fails to load is logged and retried later, never fatal.
"""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from .request import LoRARequest

logger = logging.getLogger(__name__)
RETRY_FAILED_SECONDS = 30.0


def parse_placement(text: str) -> list[str]:
    """Adapter names from the annotation's value: comma- or whitespace-separated, blanks ignored."""
    names = [name.strip() for name in text.replace("\n", ",").split(",")]
    return list(dict.fromkeys(name for name in names if name))


class PlacementWatcher:
    def __init__(self, state, placement_file: str | Path, catalog_dir: str | Path, interval: float = 2.0) -> None:
        self.state = state
        self.placement_file = Path(placement_file)
        self.catalog_dir = Path(catalog_dir)
        self.interval = interval
        self.managed: set[str] = set()  # adapters this watcher loaded
        self.failed: dict[str, float] = {}  # name -> when its load last failed

    def wanted(self) -> list[str]:
        try:
            return parse_placement(self.placement_file.read_text())
        except FileNotFoundError:
            return []  # no annotation yet: the kubelet writes an empty file, or none at all

    async def sync(self) -> None:
        """One reconciliation: load what is placed here and missing, unload what is no longer placed."""
        wanted = self.wanted()
        engine = self.state.engine
        for name in sorted(self.managed - set(wanted)):
            try:
                await self.state.async_engine.call(lambda n=name: engine.remove_lora(n))
                logger.info("placement: unloaded adapter %s", name)
            except KeyError:
                pass  # unloaded through the API meanwhile
            self.managed.discard(name)
        now = time.monotonic()
        for name in wanted:
            if engine.lora.find(name) is not None or now - self.failed.get(name, -RETRY_FAILED_SECONDS) < RETRY_FAILED_SECONDS:
                continue
            request = LoRARequest(name, self.state.new_lora_id(), str(self.catalog_dir / name))
            try:
                adapter = await asyncio.to_thread(engine.lora.read, request)
                await self.state.async_engine.call(lambda: engine.add_lora(request, adapter))
            except ValueError as error:  # LoRALoadError included
                self.failed[name] = now
                logger.error("placement: cannot load adapter %s from %s: %s", name, request.lora_path, error)
                continue
            self.failed.pop(name, None)
            self.managed.add(name)
            logger.info("placement: loaded adapter %s", name)

    async def run(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception:  # keep watching: a transient error must not end placement for good
                logger.exception("placement sync failed")
            await asyncio.sleep(self.interval)
