"""Start the ranks of this node other than the current process, one process each. They are daemons of the
serving process, so they end with it; one that outlives a killed parent finds its connection to rank 0
closed and exits non-zero.

Forked where that is safe (the platform forks and this process has not initialized CUDA, which a child
cannot inherit), as vLLM does: then `LLM(model, tensor_parallel_size=2)` works at a script's top level, as
most scripts are written. Otherwise spawned (a fresh interpreter that re-imports the main script): a script
that builds the LLM outside `if __name__ == "__main__":` would build it again in every rank and hang, so
it is refused before any process starts, with what to change.
"""
from __future__ import annotations

import ast
import multiprocessing as mp
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


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


def start_method() -> tuple[str, str]:
    """("fork" or "spawn", why spawn when it is)."""
    if "fork" not in mp.get_all_start_methods():
        return "spawn", "this platform cannot fork"
    if torch.cuda.is_initialized():
        return "spawn", "this process has initialized CUDA, which a forked rank cannot use"
    if threading.active_count() > 1:  # a forked child keeps only this thread, and any lock another one held
        return "spawn", "other threads run in this process, whose locks a forked rank would inherit held"
    return "fork", ""


def _main_guard_lines(tree: ast.Module) -> list[tuple[int, int]]:
    """Line ranges of the module's top-level `if __name__ == "__main__":` bodies."""
    ranges = []
    for node in tree.body:
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Compare) and len(test.comparators) == 1 and isinstance(test.ops[0], ast.Eq)
                and {ast.unparse(test.left), ast.unparse(test.comparators[0])} in (
                    {"__name__", "'__main__'"}, {"__name__", '"__main__"'})):
            ranges.append((node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno))
    return ranges


def unguarded_main_call() -> str | None:
    """'script.py:LINE' when the main script's top level is running the current call outside
    `if __name__ == "__main__":` (what a spawned rank would run again); None otherwise or when unknown."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", "") or ""
    # multiprocessing's spawn does not re-run a package's __main__ (`python -m pkg`), nor an interactive session
    if main is None or not path or spec_name == "__main__" or spec_name.endswith(".__main__"):
        return None
    frame = sys._getframe()
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    if any(first <= line <= last for first, last in _main_guard_lines(tree)):
        return None
    return f"{path}:{line}"


def start_local_ranks(target: Callable, config, plans: list[RankPlan]) -> list[mp.Process]:
    """`target(config, plan)` in a new process per plan (forked where safe, else spawned)."""
    method, why = start_method()
    if method == "spawn" and plans and (where := unguarded_main_call()):
        raise RuntimeError(
            f"tensor parallelism starts its {len(plans)} other rank(s) as new Python processes, and here they must "
            f"be spawned ({why}): each re-runs your script from the top, and {where} builds the LLM outside "
            "`if __name__ == \"__main__\":`, so every rank would build it again. Move that code under "
            "`if __name__ == \"__main__\":` (or into a function called from there), or build the LLM before "
            "anything initializes CUDA so that the ranks can be forked")
    context = mp.get_context(method)
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
