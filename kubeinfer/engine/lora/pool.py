"""Where adapters live: `max_loras` preallocated device slots, and a bigger LRU cache in host memory.

Device memory for adapters is allocated once, as stacked tensors per layer and module
(A [max_loras + 1, max_lora_rank, in], B [max_loras + 1, out, max_lora_rank]), so activating an
adapter is a copy into a free slot and never an allocation; slot 0 stays zero and means "no adapter".
A running request pins its adapter (`acquire`/`release`); only idle adapters are evicted, least
recently used first. A request whose adapter cannot get a slot now waits: the scheduler asks
`can_activate` before admitting it. Host memory holds at most `max_cpu_loras` adapters (vLLM's
meaning: device-resident ones included); one evicted from there is read again through `loader`.
Not thread-safe: only the engine's step loop touches it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import ModelSpec
from .adapter import LoRAAdapter, module_shapes
from .tp_slices import rank_slice


class LoRAPoolError(RuntimeError):
    """The pool cannot do what was asked right now (every slot pinned, adapter unknown or in use)."""


@dataclass
class _Entry:
    adapter: LoRAAdapter
    slot: int | None = None  # device slot, None while only in host memory
    pins: int = 0  # running sequences using it


class LoRAPool:
    def __init__(self, spec: ModelSpec, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 loader: Callable[[int], LoRAAdapter] | None = None, tp_rank: int = 0, tp_size: int = 1,
                 on_write: Callable[[int, LoRAAdapter], None] | None = None) -> None:
        """With tensor parallelism, the pool holds rank `tp_rank`'s slice of each adapter (lora/tp_slices.py);
        `on_write(slot, adapter)` tells the other ranks to write theirs into the same slot."""
        max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be positive, got {max_loras} and {max_lora_rank}")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})")
        spec = spec.for_rank(tp_rank, tp_size)
        self.spec, self.on_write = spec, on_write
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.loader = loader
        self.device = torch.device(device)
        slots = max_loras + 1
        kw = dict(device=device, dtype=dtype)
        shapes = module_shapes(spec)
        self.lora_a = [{m: torch.zeros(slots, max_lora_rank, i, **kw) for m, (i, _) in shapes.items()}
                       for _ in range(spec.num_layers)]
        self.lora_b = [{m: torch.zeros(slots, o, max_lora_rank, **kw) for m, (_, o) in shapes.items()}
                       for _ in range(spec.num_layers)]
        # Per slot: the occupant's rank (0 = empty) and the (layer, module) pairs it wrote, so the
        # delta skips what the occupant leaves at zero and the next occupant clears only what it must.
        self.slot_rank = [0] * slots
        self.slot_targets: list[frozenset[tuple[int, str]]] = [frozenset()] * slots
        # The same on the device, as one table: rank_table[i, slot] is the rank the slot's occupant has
        # on module_keys[i] (0 when it does not target it), for kernels that look ranks up per token.
        self.module_keys = [(layer, name) for layer in range(spec.num_layers) for name in shapes]
        self.rank_table = torch.zeros(len(self.module_keys), slots, dtype=torch.int32, device=device)
        self._slot_owner: list[int | None] = [None] * slots
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first

    # -- host cache -------------------------------------------------------------------------------
    def add(self, adapter: LoRAAdapter) -> None:
        """Cache `adapter` in host memory, evicting idle ones (least recently used first) to make room."""
        if adapter.id < 1:
            raise ValueError(f"adapter ids start at 1 (0 is the base model), got {adapter.id}")
        if adapter.rank > self.max_lora_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank} > max_lora_rank={self.max_lora_rank}")
        entry = self._entries.get(adapter.id)
        if entry is not None:
            if entry.adapter.name != adapter.name:
                raise LoRAPoolError(f"adapter id {adapter.id} already belongs to {entry.adapter.name!r}")
            self._entries.move_to_end(adapter.id)
            return
        while len(self._entries) >= self.max_cpu_loras:
            self._drop(self._host_victim())
        self._entries[adapter.id] = _Entry(adapter)

    def remove(self, lora_id: int) -> None:
        """Forget an adapter (unload); refused while a running request uses it."""
        entry = self._entries.get(lora_id)
        if entry is None:
            raise LoRAPoolError(f"adapter id {lora_id} is not loaded")
        if entry.pins:
            raise LoRAPoolError(f"adapter {entry.adapter.name!r} is in use by {entry.pins} running request(s)")
        self._drop(lora_id)

    def has(self, lora_id: int) -> bool:
        return lora_id in self._entries

    # -- device slots -----------------------------------------------------------------------------
    def is_active(self, lora_id: int) -> bool:
        entry = self._entries.get(lora_id)
        return lora_id == 0 or (entry is not None and entry.slot is not None)

    def slot_of(self, lora_id: int) -> int:
        """The device slot of an active adapter (0 for the base model)."""
        if lora_id == 0:
            return 0
        entry = self._entries.get(lora_id)
        if entry is None or entry.slot is None:
            raise LoRAPoolError(f"adapter id {lora_id} is not on the device; activate it first")
        return entry.slot

    def can_activate(self, lora_id: int) -> bool:
        """Whether `activate(lora_id)` would succeed now: already active, a free slot, or an idle one to evict."""
        return self.is_active(lora_id) or self._free_slot() is not None or self._slot_victim() is not None

    def activate(self, lora_id: int) -> int:
        """Put the adapter in a device slot (reading it through `loader` if evicted from host memory)."""
        if lora_id == 0:
            return 0
        if lora_id not in self._entries:
            if self.loader is None:
                raise LoRAPoolError(f"adapter id {lora_id} is not loaded")
            if not self.can_activate(lora_id):  # check first: loading would evict for nothing
                raise LoRAPoolError(self._busy_message())
            self.add(self.loader(lora_id))
        entry = self._entries[lora_id]
        self._entries.move_to_end(lora_id)
        if entry.slot is None:
            slot = self._free_slot()
            if slot is None:
                victim = self._slot_victim()
                if victim is None:
                    raise LoRAPoolError(self._busy_message())
                slot = self._deactivate(victim)
            self._write_slot(slot, entry.adapter)
            entry.slot = slot
        return entry.slot

    def acquire(self, lora_id: int) -> int:
        """Activate and pin the adapter for one running sequence; returns its slot."""
        slot = self.activate(lora_id)
        if lora_id:
            self._entries[lora_id].pins += 1
        return slot

    def release(self, lora_id: int) -> None:
        """Unpin once (the sequence finished or was preempted); the adapter stays cached until evicted."""
        if lora_id == 0:
            return
        entry = self._entries.get(lora_id)
        if entry is None or entry.pins == 0:
            raise LoRAPoolError(f"adapter id {lora_id} is not acquired")
        entry.pins -= 1

    # -- names for metrics and /v1/models ---------------------------------------------------------
    def active_names(self) -> list[str]:
        return [e.adapter.name for e in self._entries.values() if e.slot is not None]

    def cached_names(self) -> list[str]:
        return [e.adapter.name for e in self._entries.values()]

    def pinned_names(self) -> list[str]:
        return [e.adapter.name for e in self._entries.values() if e.pins]

    # -- internals --------------------------------------------------------------------------------
    def _free_slot(self) -> int | None:
        return next((s for s in range(1, self.max_loras + 1) if self._slot_owner[s] is None), None)

    def _slot_victim(self) -> int | None:
        return next((i for i, e in self._entries.items() if e.slot is not None and not e.pins), None)

    def _host_victim(self) -> int:
        idle = [i for i, e in self._entries.items() if not e.pins]
        victim = next((i for i in idle if self._entries[i].slot is None), None)  # spare device residents
        if victim is None and idle:
            victim = idle[0]
        if victim is None:
            raise LoRAPoolError(f"all {len(self._entries)} cached adapters are in use; raise --max-cpu-loras")
        return victim

    def _busy_message(self) -> str:
        return f"all {self.max_loras} adapter slots are pinned by running requests"

    def _drop(self, lora_id: int) -> None:
        if self._entries[lora_id].slot is not None:
            self._deactivate(lora_id)
        del self._entries[lora_id]

    def _deactivate(self, lora_id: int) -> int:
        # The slot's tensors keep the old weights: no token is routed to a free slot, and the
        # next occupant clears what it does not overwrite.
        entry = self._entries[lora_id]
        slot, entry.slot = entry.slot, None
        self._slot_owner[slot] = None
        self.slot_rank[slot] = 0
        self.rank_table[:, slot] = 0
        return slot

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        if self.on_write is not None:
            self.on_write(slot, adapter)
        self.write_slot(slot, adapter)

    @torch.no_grad()
    def write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy this rank's slice of the adapter into `slot` (the other ranks call it for rank 0's writes)."""
        for layer, module in self.slot_targets[slot] - adapter.weights.keys():
            self.lora_a[layer][module][slot].zero_()
            self.lora_b[layer][module][slot].zero_()
        for (layer, module), w in adapter.weights.items():
            w = rank_slice(w, module, self.spec)
            a, b = self.lora_a[layer][module][slot], self.lora_b[layer][module][slot]
            a[:w.rank].copy_(w.a)
            a[w.rank:].zero_()
            b[:, :w.rank].copy_(w.b)
            b[:, w.rank:].zero_()
        self.slot_targets[slot] = frozenset(adapter.weights)
        self.slot_rank[slot] = adapter.rank
        self.rank_table[:, slot] = torch.tensor([adapter.weights[key].rank if key in adapter.weights else 0
                                                 for key in self.module_keys], dtype=torch.int32)
        self._slot_owner[slot] = adapter.id
