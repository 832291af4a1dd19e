"""Rank 0's side of a tensor-parallel group: start the node's other ranks, meet every rank (torch.distributed
and the step channel), hand them each step, watch them, and end them.

The serving process is rank 0 and keeps the scheduler, the sampler and the API; every other rank holds
its slice of the model and KV cache and runs what rank 0 sends (core/tp_worker.py). With several nodes,
node 0's process is rank 0 and the others run `kubeinfer serve --headless` (tp_worker.run_headless)."""
from __future__ import annotations

import logging
import time

import torch

from ..config import EngineConfig, ModelSpec
from ..distributed.failure_watch import FailureWatch, RankFailedError
from ..distributed.group_auth import group_secret
from ..distributed.launch import RankPlan, cpu_threads_per_rank, start_local_ranks
from ..distributed.parallel_state import destroy_group, init_group
from ..distributed.step_channel import StepSender, free_port
from ..model_executor.models.registry import ARCHITECTURES
from .tp_messages import check_message

logger = logging.getLogger(__name__)


def rank_ports(config: EngineConfig) -> tuple[int, int]:
    """(torch.distributed's rendezvous port, the step channel's): the master port and the one after it, which
    the other nodes know; on one node without a master port, free ones (0: the system picks)."""
    if config.master_port is None:
        return free_port(config.master_addr), 0
    return config.master_port, config.master_port + 1


class TensorParallelGroup:
    def __init__(self, config: EngineConfig, spec: ModelSpec, device: torch.device) -> None:
        world = config.world_size
        if not ARCHITECTURES[spec.architecture].tensor_parallel:
            supported = ", ".join(a.name for a in ARCHITECTURES.values() if a.tensor_parallel)
            raise ValueError(f"tensor parallelism is not supported on {spec.architecture} yet; it runs on {supported}")
        spec.for_rank(0, world)  # a model that does not split evenly is refused before any process starts
        if device.type == "cuda" and torch.cuda.device_count() < config.ranks_per_node:
            raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size} over {config.nnodes} node(s) needs "
                             f"{config.ranks_per_node} GPUs on this node, and torch sees {torch.cuda.device_count()}")
        secret = group_secret(config.nnodes)  # over several nodes: refused here, before any process, without one
        self.config, self.processes, self.world_size = config, [], world
        # On the CPU the node's ranks share its cores: rank 0 takes its share too (given back at shutdown).
        self._threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(config.ranks_per_node))
        dist_port, step_port = rank_ports(config)
        self.sender = StepSender(config.master_addr, step_port, secret)
        plans = [RankPlan(rank, rank, world, config.master_addr, dist_port, self.sender.port, secret)
                 for rank in range(1, config.ranks_per_node)]
        from .tp_worker import run_worker

        try:
            self.processes = start_local_ranks(run_worker, config, plans)
            logger.info("tensor parallel: %d ranks (%d per node on %d nodes); waiting for them to join",
                        world, config.ranks_per_node, config.nnodes)
            init_group(0, world, 0, config.master_addr, dist_port, device, config.distributed_timeout)
            self.sender.accept(list(range(1, world)), config.distributed_timeout)
            self.sender.send(check_message(("config", config)))  # followers on other nodes build from rank 0's settings
        except BaseException:
            self.shutdown()
            raise
        self.watch = FailureWatch(self.sender.connections, self._describe)
        self.watch.start()

    def send(self, message: tuple) -> None:
        """Hand a message (a step, a KV cache size, an adapter's slot) to every other rank."""
        if self.watch.reason is not None:
            raise RankFailedError(self.watch.reason)
        try:
            self.sender.send(check_message(message))
        except OSError as error:
            raise self.step_failed(error) from error

    def step_failed(self, error: Exception) -> RankFailedError:
        # A collective fails as soon as a peer's socket drops; the watch names the rank a moment later.
        self.watch.failed.wait(timeout=1.0)
        reason = self.watch.reason or f"a tensor-parallel step failed: {type(error).__name__}: {error}"
        self.watch.fail(reason)
        return RankFailedError(reason)

    def _describe(self, rank: int) -> str:
        process = self.processes[rank - 1] if 0 < rank <= len(self.processes) else None
        if process is None:
            return "its connection closed"
        deadline = time.monotonic() + 5  # its socket closes while the kernel still tears it down
        process.join(timeout=5)
        while process.exitcode is None and time.monotonic() < deadline:  # another thread may be reaping it now
            time.sleep(0.05)
        return "still running" if process.exitcode is None else f"exit code {process.exitcode}"

    def shutdown(self) -> None:
        """A clean end tells the other ranks to stop (they exit 0). After a failure they are not told: their
        connection to rank 0 closes and they exit non-zero, as a failed group must."""
        watch = getattr(self, "watch", None)
        failed = watch is None or watch.reason is not None
        if watch is not None:
            watch.stop()
        if not failed:
            try:
                self.sender.send(("stop",))
            except OSError:
                failed = True
        if failed:
            self.sender.close()
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        self.sender.close()
        destroy_group()
        torch.set_num_threads(self._threads)
