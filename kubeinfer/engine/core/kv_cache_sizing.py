"""How many KV-cache blocks fit on a GPU: `--gpu-memory-utilization`.

The engine may use `utilization x total` bytes of the device (vLLM's meaning: a per-engine share, so
two engines at 0.45 can share one GPU). After the weights are loaded, one profiling forward pass of
the largest step the scheduler can build finds the activation peak; the KV cache gets what is left:

    kv_bytes = total * utilization - torch peak (weights + activations) - non-torch growth

"Non-torch growth" is what the process took outside torch's allocator while loading and profiling
(cuBLAS workspaces, Triton modules); the CUDA context itself was already held when measuring began.
CUDA graphs are captured after the cache is allocated: they record decode steps, whose activations
are far smaller than the profiled prefill step's, in memory that step's peak already accounted for.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class GpuMemoryProfile:
    total: int  # device memory in bytes
    free_at_start: int  # free before the model was loaded (other processes and our CUDA context excluded)
    torch_peak: int  # torch.cuda.max_memory_allocated after loading and the profiling step
    non_torch_growth: int  # memory taken outside torch's allocator since the start


def kv_cache_bytes(profile: GpuMemoryProfile, utilization: float) -> int:
    """Bytes left for the KV cache; raises ValueError, saying what to change, when the share cannot be had."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    requested = int(profile.total * utilization)
    if requested > profile.free_at_start:
        raise ValueError(
            f"gpu_memory_utilization {utilization} asks for {requested / GiB:.2f} GiB but only "
            f"{profile.free_at_start / GiB:.2f} of {profile.total / GiB:.2f} GiB were free at start-up (other "
            "processes hold the rest); lower --gpu-memory-utilization or free the GPU")
    left = requested - profile.torch_peak - profile.non_torch_growth
    if left <= 0:
        raise ValueError(
            f"no memory is left for the KV cache: the model's weights and a profiled step take "
            f"{(profile.torch_peak + profile.non_torch_growth) / GiB:.2f} GiB of the {requested / GiB:.2f} GiB that "
            "gpu_memory_utilization allows; raise --gpu-memory-utilization, or lower --max-num-batched-tokens")
    return left


def num_kv_blocks(kv_bytes: int, bytes_per_block: int, *, block_size: int, max_model_len: int) -> int:
    """Blocks that fit in kv_bytes; at least enough for one sequence of max_model_len tokens, or an error."""
    blocks = kv_bytes // bytes_per_block
    needed = -(-max_model_len // block_size)
    if blocks < needed:
        raise ValueError(
            f"the KV cache fits {blocks * block_size} tokens ({kv_bytes / GiB:.2f} GiB), fewer than one sequence of "
            f"max_model_len {max_model_len} needs; raise --gpu-memory-utilization or lower --max-model-len")
    return blocks


def measure_gpu(device, load_and_profile) -> tuple[GpuMemoryProfile, object]:
    """Runs load_and_profile() (loads the model, runs the profiling step; returns what it built) and
    measures the device around it. CUDA only."""
    import torch

    torch.cuda.synchronize(device)
    free_at_start, total = torch.cuda.mem_get_info(device)  # also creates the context, so it is not counted
    reserved_at_start = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    built = load_and_profile()
    torch.cuda.synchronize(device)
    free_now, _ = torch.cuda.mem_get_info(device)
    torch_growth = torch.cuda.memory_reserved(device) - reserved_at_start
    non_torch = max(0, (free_at_start - free_now) - torch_growth)
    profile = GpuMemoryProfile(total=total, free_at_start=free_at_start,
                               torch_peak=torch.cuda.max_memory_allocated(device), non_torch_growth=non_torch)
    torch.cuda.empty_cache()  # the profiling step's activations go back, for the KV cache to take
    return profile, built


@contextlib.contextmanager
def out_of_memory_says(what: str, remedy: str):
    """A CUDA out-of-memory error at start-up becomes a ValueError that says what ran out and what to change."""
    import torch

    try:
        yield
    except torch.cuda.OutOfMemoryError as error:
        raise ValueError(f"{what} ran out of GPU memory ({str(error).splitlines()[0]}); {remedy}") from None
