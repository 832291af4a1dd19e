"""The endpoint pool as columns, for the picker: one numpy array per load figure (one row per endpoint)
and, per model name, the rows that serve it.

Why: scoring 500 endpoints one Python object at a time took about 1 ms per pick; the same arithmetic
on arrays takes tens of microseconds. `Endpoint`s stay the source of truth. Each change to one marks
its address in the pool's `changes` set, and `sync()` rewrites only those rows (a pick's own dispatch,
the scrapes since the last pick); a membership change rebuilds the table.
"""
from __future__ import annotations

import hashlib

import numpy as np

from .endpoints import Endpoint, EndpointPool


def address_key(address: str) -> int:
    """A 64-bit name of an endpoint, mixed with a prompt's affinity key for rendezvous hashing."""
    return int.from_bytes(hashlib.blake2b(address.encode(), digest_size=8).digest(), "little")


class NameIndex:
    """Which rows list each name (models served, adapters assigned, running, waiting), with the
    boolean mask of a name built once and kept until a row gains or loses that name."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._rows: dict[str, set[int]] = {}
        self._names: list[frozenset[str]] = [frozenset()] * size
        self._masks: dict[str, np.ndarray] = {}

    def set(self, row: int, names: frozenset[str]) -> None:
        old = self._names[row]
        if old == names:
            return
        for name in old - names:
            rows = self._rows[name]
            rows.discard(row)
            if not rows:
                del self._rows[name]
            self._masks.pop(name, None)
        for name in names - old:
            self._rows.setdefault(name, set()).add(row)
            self._masks.pop(name, None)
        self._names[row] = names

    def mask(self, name: str) -> np.ndarray:
        """Read-only: combine it into new arrays, never in place."""
        mask = self._masks.get(name)
        if mask is None:
            mask = np.zeros(self.size, dtype=bool)
            mask[list(self._rows.get(name, ()))] = True
            mask.flags.writeable = False
            self._masks[name] = mask
        return mask

    def __contains__(self, name: str) -> bool:
        return name in self._rows


class LoadTable:
    def __init__(self, pool: EndpointPool) -> None:
        self.pool = pool
        self._version: int | None = None
        self._build([])

    def _build(self, endpoints: list[Endpoint]) -> None:
        n = len(endpoints)
        self.endpoints = endpoints
        self.rows = {e.address: i for i, e in enumerate(endpoints)}
        self.address_keys = np.array([address_key(e.address) for e in endpoints], dtype=np.uint64)
        self.scraped_at = np.full(n, -np.inf)  # monotonic time of the last good scrape; -inf: never
        self.failures = np.zeros(n)
        self.queue = np.zeros(n)  # Endpoint.queue: waiting plus our unseen dispatches
        self.active = np.zeros(n)  # Endpoint.active
        self.kv_usage = np.zeros(n)
        self.free_adapter_slot = np.zeros(n, dtype=bool)  # fewer adapters running than max_loras
        self.batch_full = np.zeros(n, dtype=bool)  # as many requests active as the engine runs at once
        self.loaded, self.base, self.assigned = NameIndex(n), NameIndex(n), NameIndex(n)
        self.running_adapters, self.waiting_adapters = NameIndex(n), NameIndex(n)
        for row in range(n):
            self._write(row)

    def sync(self) -> None:
        pool = self.pool
        if pool.version != self._version or len(pool.endpoints) != len(self.endpoints):
            self._version = pool.version
            pool.changes.clear()
            self._build(list(pool.endpoints.values()))
            return
        while pool.changes:
            row = self.rows.get(pool.changes.pop())
            if row is not None:
                self._write(row)

    def _write(self, row: int) -> None:
        e = self.endpoints[row]
        state = e.state
        self.scraped_at[row] = e.last_scrape if state is not None and e.last_scrape is not None else -np.inf
        self.failures[row] = e.consecutive_failures
        self.queue[row], self.active[row] = e.queue, e.active
        self.kv_usage[row] = state.kv_usage if state else 0.0
        self.free_adapter_slot[row] = state is not None and len(state.running_adapters) < state.max_loras
        self.batch_full[row] = state is not None and 0 < state.max_running <= e.active
        self.loaded.set(row, e.models)
        self.base.set(row, e.base_models)
        self.assigned.set(row, e.placed_adapters - e.refused_models)
        self.running_adapters.set(row, state.running_adapters if state else frozenset())
        self.waiting_adapters.set(row, state.waiting_adapters if state else frozenset())

    def ready(self, now: float, stale_after: float, max_failures: int) -> np.ndarray:
        """Scraped recently and not failing, for every row: stale numbers are never trusted."""
        return (now - self.scraped_at <= stale_after) & (self.failures < max_failures)

    def addresses(self, addresses: frozenset[str]) -> np.ndarray:
        mask = np.zeros(len(self.endpoints), dtype=bool)
        mask[[self.rows[a] for a in addresses if a in self.rows]] = True
        return mask

    def serving(self, model: str, among: np.ndarray) -> np.ndarray:
        """Rows of `among` that list the model in their own /v1/models (observed, not intended: placement
        may not have loaded), else those it is assigned to and that have not refused it (they load it)."""
        if not model:
            return among
        loaded = among & self.loaded.mask(model)
        return loaded if loaded.any() else among & self.assigned.mask(model)

    def knows(self, model: str) -> bool:
        """Some endpoint, ready or not, serves or is assigned the model."""
        return model in self.loaded or model in self.assigned
