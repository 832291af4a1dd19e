"""Engine configuration: the user's knobs, with defaults resolved against the model and the machine."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

# KV cache memory when the user gives no block count and the device is a CPU (vLLM's CPU default is 4 GiB).
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


@dataclass
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES  # the CPU's KV budget; on CUDA see gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # this engine's share of GPU memory: weights, activations and KV cache
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    enable_prefix_caching: bool = True
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    attention_backend: str | None = None  # "torch" | "triton"; default: triton on CUDA (when installed), else torch
    seed: int = 0
    tokenizer: str | None = None  # defaults to the model directory

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                     "max_loras", "max_lora_rank"):
            positive(name)
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.attention_backend is None:
            on_gpu = self.device.startswith("cuda") and importlib.util.find_spec("triton") is not None
            self.attention_backend = "triton" if on_gpu else "torch"
