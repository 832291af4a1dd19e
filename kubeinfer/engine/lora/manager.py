"""The adapters one engine serves: which names and ids exist, their weights in the pool, and unloading
that never pulls an adapter from under a request in flight.

Reading an adapter (`read`) touches no engine state, so servers do it off the engine thread; every
other method runs on the engine thread, like the pool it owns. An adapter unloaded while requests
still use it disappears from the registry at once (new requests cannot name it) and its weights stay
until its last sequence finishes (`retire_idle`).

Each registration also gets a generation number, never reused, that the prefix cache keys on (see
`generation`).
"""
from __future__ import annotations

import itertools

import torch

from ..config import ModelSpec
from .adapter import LoRAAdapter, load_adapter
from .pool import LoRAPool, LoRAPoolError
from .request import LoRARequest


class LoRAManager:
    def __init__(self, spec: ModelSpec, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                 device: torch.device, dtype: torch.dtype, ranks=None) -> None:
        """`ranks`: rank 0's tensor-parallel group (core/tensor_parallel.py): the pool holds rank 0's slice of each
        adapter, and each slot write is sent to the other ranks, which write theirs."""
        self.spec, self.max_lora_rank, self.dtype = spec, max_lora_rank, dtype
        on_write = None if ranks is None else (lambda slot, adapter: ranks.send(("lora", slot, adapter)))
        self.pool = LoRAPool(spec, max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                             device=device, dtype=dtype, loader=self._reread, tp_size=ranks.world_size if ranks else 1,
                             on_write=on_write)
        self.registered: dict[int, LoRARequest] = {}  # by lora_int_id
        self.retiring: dict[int, LoRARequest] = {}  # unloaded, still used by sequences in flight
        self._generations: dict[int, int] = {}  # lora_int_id -> its registration's generation
        self._next_generation = itertools.count(1)  # 0 stands for "no adapter"

    def read(self, request: LoRARequest) -> LoRAAdapter:
        """Load and validate the adapter's files; raises LoRALoadError with what to fix. Thread-safe."""
        return load_adapter(request.lora_path, self.spec, self.max_lora_rank, lora_id=request.lora_int_id,
                            name=request.lora_name, dtype=self.dtype)

    def find(self, name: str) -> LoRARequest | None:
        return next((r for r in self.registered.values() if r.lora_name == name), None)

    def register(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """Make the adapter available to requests (reading it now if `adapter` is not given).
        Registering the same request again is a no-op; a clashing name or id is a ValueError."""
        existing = self.registered.get(request.lora_int_id)
        if existing == request:
            return
        if existing is not None:
            raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter {existing.lora_name!r}")
        if self.find(request.lora_name) is not None:
            raise ValueError(f"an adapter named {request.lora_name!r} is already loaded")
        if request.lora_int_id in self.retiring:
            raise ValueError(f"lora_int_id {request.lora_int_id} belongs to an adapter still finishing its requests")
        adapter = adapter or self.read(request)
        try:
            self.pool.add(adapter)
        except LoRAPoolError:
            pass  # host cache full of adapters in use: the pool reads this one from disk when it is needed
        self.registered[request.lora_int_id] = request
        self._generations[request.lora_int_id] = next(self._next_generation)

    def unregister(self, lora_id: int, in_use: set[int]) -> LoRARequest:
        """Forget the adapter; its weights go now, or when the sequences in `in_use` that need it finish."""
        request = self.registered.pop(lora_id)
        del self._generations[lora_id]
        if lora_id in in_use:
            self.retiring[lora_id] = request
        elif self.pool.has(lora_id):
            self.pool.remove(lora_id)
        return request

    def generation(self, lora_id: int) -> int:
        """Which registration of `lora_id` new requests get (0 if none), for the prefix-cache key.

        Users may unload an adapter and load another under the same `lora_int_id`; KV blocks computed
        with the old weights must then never be reused. Keying blocks by a generation that is never reused
        makes them unreachable the moment the adapter goes, and stays right for the old adapter's sequences
        still in flight: they keep committing blocks, under their own generation. Dropping the adapter's
        blocks at unload instead would need every block tagged with its adapter, and a second drop when
        the last of those sequences ends. Stale blocks are freed like others and age out in LRU order."""
        return self._generations.get(lora_id, 0)

    def retire_idle(self, in_use: set[int]) -> None:
        for lora_id in [i for i in self.retiring if i not in in_use]:
            del self.retiring[lora_id]
            if self.pool.has(lora_id):
                self.pool.remove(lora_id)

    def names(self, lora_ids: set[int]) -> list[str]:
        known = {**self.retiring, **self.registered}
        return sorted(known[i].lora_name for i in lora_ids if i in known)

    def _reread(self, lora_id: int) -> LoRAAdapter:
        """The pool's loader, for an adapter it dropped from host memory (beyond max_cpu_loras)."""
        request = self.registered.get(lora_id) or self.retiring.get(lora_id)
        if request is None:
            raise LoRAPoolError(f"adapter id {lora_id} is not loaded")
        return self.read(request)
