"""This process's place in the tensor-parallel group, and the collectives the layers need.

One group per engine: every rank holds a slice of every layer. Outside a group (the default, and every
single-device engine) the rank is 0 of 1 and no collective runs: `all_reduce`, `all_reduce_max` and
`gather_last_dim` return their input. The group is gloo on the CPU and NCCL on CUDA (torch.distributed)."""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .listen import listen_on


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    local_rank: int = 0  # the rank within its node: its GPU on CUDA


_group = TPGroup()


def tp_group() -> TPGroup:
    """This process's place in its group (rank 0 of 1 outside any)."""
    return _group


def init_group(rank: int, size: int, local_rank: int, master_addr: str, master_port: int, device: torch.device,
               timeout_s: float) -> None:
    """Join the group (blocks until all `size` ranks have); `timeout_s` bounds every collective after it.

    Rank 0 hosts torch's rendezvous (a TCPStore) on a socket of its own bound to `master_addr` (listen.py): torch
    would bind every interface."""
    global _group
    if dist.is_initialized():  # torch.distributed has one default group per process
        raise ValueError("this process already runs a tensor-parallel engine; shut it down first (LLM.shutdown())")
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    listen_fd = listen_on(master_addr, master_port).detach() if rank == 0 else None  # the store owns it from here
    store = dist.TCPStore(master_addr, master_port, world_size=size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False, master_listen_fd=listen_fd)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    _group = TPGroup(rank, size, local_rank)


def destroy_group() -> None:
    global _group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = TPGroup()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of each rank's `x`, in place (row-parallel projections, vocab-parallel embedding)."""
    if _group.size > 1:
        dist.all_reduce(x)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """The elementwise max over ranks of each rank's `x`, in place (the whole token's activation range of a
    W8A8 row-parallel layer, layers/quantization/w8a8_tp.py); the same collective as `all_reduce`, so it is
    captured in CUDA graphs alike."""
    if _group.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Rank 0: the ranks' `x` side by side along the last dimension (their vocabulary slices of the logits);
    other ranks: their own `x` (they sample nothing)."""
    if _group.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_group.size)] if _group.rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else x
