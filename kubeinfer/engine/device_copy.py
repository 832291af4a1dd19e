"""Host values to the device without making the host wait.

A copy from pageable host memory to a GPU is synchronous: the host waits for every kernel queued before it
on the stream, the previous step's forward pass included. That would undo async scheduling and the
sampler's overlap, so a step's small inputs go through pinned memory with a `non_blocking` copy, queued
behind that work instead (PyTorch's pinned allocator keeps the memory until its copy has run). On a CPU
they are plain tensors.
"""
from __future__ import annotations

import torch


def on_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a tensor on `device`."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A tensor on `device` (itself when it is there already)."""
    if torch.device(device).type != "cuda" or tensor.is_cuda:
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
