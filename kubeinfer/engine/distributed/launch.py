"""Start the ranks of this node other than the current process, one process each (spawned: a fresh
interpreter, no CUDA state inherited). They are daemons of the serving process, so they end with it;
one that outlives a killed parent finds its connection to rank 0 closed and exits non-zero."""
from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RankPlan:
    """Where a rank sits in the group and how it reaches rank 0."""
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    dist_port: int  # torch.distributed's rendezvous
    step_port: int  # rank 0's step channel
    secret: bytes = field(default=b"", repr=False)  # the group's (group_auth): handed to spawned ranks, never sent


def start_local_ranks(target: Callable, config, plans: list[RankPlan]) -> list[mp.Process]:
    """`target(config, plan)` in a new process per plan."""
    context = mp.get_context("spawn")
    processes = []
    for plan in plans:
        process = context.Process(target=target, args=(config, plan), name=f"kubeinfer-tp-rank-{plan.rank}",
                                  daemon=True)
        process.start()
        processes.append(process)
    return processes


def cpu_threads_per_rank(local_ranks: int) -> int:
    """The node's cores shared among its ranks (torch's intra-op threads of each)."""
    return max(1, (os.cpu_count() or 1) // local_ranks)
