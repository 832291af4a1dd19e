"""The peak of the bytes torch holds live while a block of code runs (here: an engine's load), counted per
storage as torch's operators create them (a dispatch mode sees every tensor an operator returns; a storage is
counted from its first appearance until torch frees it). Tensors made outside torch's operators (a safetensors
file's reads) are not counted: what is measured is what the engine allocates."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes() as live: ...`, then `live.peak` (bytes) and `live.now`; meta tensors hold none."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.sizes:
                    self.sizes[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._freed, key)  # torch keeps a storage's Python object alive with it
        return out

    def _freed(self, key: int) -> None:
        self.now -= self.sizes.pop(key, 0)


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (tied ones once), meta shapes excluded."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta"}
    return sum(seen.values())
