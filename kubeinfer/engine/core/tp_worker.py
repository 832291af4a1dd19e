"""A tensor-parallel rank other than 0: load this rank's slice of the model, then run what rank 0 sends
(core/tensor_parallel.py) until it says stop (exit 0) or is gone (exit 1). Any error exits non-zero, so
that the group's failure is seen (rank 0 dies with it) and Kubernetes restarts the pod."""
from __future__ import annotations

import dataclasses
import logging
import sys

import torch

import kubeinfer.engine.envs as envs
from ..config import EngineConfig, ModelSpec
from ..distributed.group_auth import HandshakeError, group_secret
from ..distributed.launch import RankPlan, cpu_threads_per_rank, start_local_ranks
from ..distributed.parallel_state import init_group
from ..distributed.step_channel import StepReceiver
from ..distributed.wire import WireError
from ..lora.pool import LoRAPool
from ..model_executor.cuda_graphs import capture_cuda_graph, replay_eagerly
from ..model_executor.layers.attention_selector import check_attention_backend
from ..model_executor.layers.quantization.kv_cache_dtype import (
    cache_dtype,
    checkpoint_kv_scales,
    install_kv_scales,
    scaled,
)
from ..model_executor.model_loader import inspect_model_dir, resolve_dtype
from ..model_executor.model_runner import ModelRunner
from .tp_messages import check_message

logger = logging.getLogger(__name__)


def run_worker(config: EngineConfig, plan: RankPlan) -> None:
    """A started (forked or spawned) rank's whole life; ends the process with its exit code."""
    # force: a forked rank inherits rank 0's handlers, and its lines must still say which rank wrote them
    logging.basicConfig(level=envs.LOG_LEVEL.get(), force=True,
                        format=f"%(asctime)s %(levelname)s rank{plan.rank} %(name)s: %(message)s")
    sys.exit(serve_rank(config, plan))


def serve_rank(config: EngineConfig, plan: RankPlan) -> int:
    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", plan.local_rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(cpu_threads_per_rank(config.ranks_per_node))
    try:
        init_group(plan.rank, plan.world_size, plan.local_rank, plan.master_addr, plan.dist_port, device,
                   config.distributed_timeout)
        channel = StepReceiver(plan.master_addr, plan.step_port, plan.rank, config.distributed_timeout, plan.secret)
        kind, *args = check_message(channel.recv())
        if kind != "config":
            raise RuntimeError(f"rank 0 sent {kind!r} before its configuration")
        [leader] = args
        # Rank 0's settings (block size, dtype, LoRA slots...) whatever this node's flags say; its own model path.
        runner = build_rank_runner(dataclasses.replace(leader, model=config.model), plan, device)
        follow(runner, channel)
    except ConnectionError:
        logger.critical("rank 0 is gone; exiting")
        return 1
    except (HandshakeError, WireError) as error:  # not our rank 0, or a message outside the schema: nothing run
        logger.critical("%s; exiting", error)
        return 1
    except Exception:
        logger.exception("tensor-parallel rank %d failed", plan.rank)
        return 1
    return 0


def build_rank_runner(config: EngineConfig, plan: RankPlan, device: torch.device) -> ModelRunner:
    files = inspect_model_dir(config.model, config.quantization)
    spec = ModelSpec(files.config, files.architecture)
    dtype = resolve_dtype(config.dtype, files.config, device)
    max_model_len = config.max_model_len or spec.max_position_embeddings
    pool = None
    if config.enable_lora:
        pool = LoRAPool(spec, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                        max_cpu_loras=config.max_cpu_loras, device=device, dtype=dtype,
                        tp_rank=plan.rank, tp_size=plan.world_size)
    runner = ModelRunner(files, device=device, dtype=dtype, max_model_len=max_model_len, block_size=config.block_size,
                         attention_backend=check_attention_backend(config.attention_backend, device), lora_pool=pool,
                         tp_rank=plan.rank, tp_size=plan.world_size)
    kv_dtype = cache_dtype(config.kv_cache_dtype, dtype)
    if kv_dtype != dtype:  # rank 0's cache type here too, and for 8 bits the checkpoint's per-layer scales
        runner.cache_dtype = kv_dtype
        if scaled(kv_dtype):
            install_kv_scales(runner.model, checkpoint_kv_scales(files.weight_files))
    return runner


@torch.inference_mode()
def follow(runner: ModelRunner, channel: StepReceiver) -> None:
    """Run rank 0's messages in order until "stop"."""
    while True:
        kind, *args = check_message(channel.recv())
        if kind == "step":
            runner.run_model(*args)
        elif kind == "lora":  # rank 0 wrote an adapter into a slot: this rank writes its slice of it
            runner.lora_pool.write_slot(*args)
        elif kind == "profile":
            runner.profile_run(*args)
        elif kind == "kv_cache":
            runner.num_window_blocks = args[1]
            runner.allocate_kv_cache(*args)
        elif kind == "graphs":  # (max_num_seqs, replay eagerly: the graph path's stand-in off the GPU, for tests)
            max_num_seqs, eagerly = args
            runner.capture_decode_graphs(max_num_seqs, capture=replay_eagerly if eagerly else capture_cuda_graph)
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown message from rank 0: {kind!r}")


def run_headless(config: EngineConfig) -> int:
    """A node other than 0 (`kubeinfer serve --headless`): its ranks, no API; returns the exit code."""
    tp, first = config.ranks_per_node, config.node_rank * config.ranks_per_node
    dist_port, step_port = config.master_port, config.master_port + 1
    secret = group_secret(config.nnodes)
    plans = [RankPlan(first + i, i, config.world_size, config.master_addr, dist_port, step_port, secret)
             for i in range(tp)]
    children = start_local_ranks(run_worker, config, plans[1:])
    code = serve_rank(config, plans[0])
    for child in children:
        child.join(timeout=None if code == 0 else 5)
        if child.is_alive():
            child.terminate()
        code = code or (child.exitcode != 0)
    return int(code)
