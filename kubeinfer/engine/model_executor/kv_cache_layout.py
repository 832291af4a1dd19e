"""The KV cache's tensors: one (key, value) pair per layer of [blocks, block_size, kv_heads, head_dim], and the
windowed layers' own pool on models that mix windowed and full layers (core/window_blocks.py)."""
from __future__ import annotations

import torch


def kv_bytes_per_block(spec, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    layers = spec.num_layers if num_layers is None else num_layers
    return 2 * layers * block_size * spec.num_kv_heads * spec.head_dim * element


def window_group(spec) -> int | None:
    """The window of the layers that get a pool of their own (core/window_blocks.py): on models mixing
    windowed and full layers with one window; None otherwise."""
    windows = set(spec.layer_windows)
    return next(iter(windows - {None})) if len(windows) == 2 and None in windows else None


def new_kv_cache(spec, block_size: int, dtype: torch.dtype, device: torch.device, num_blocks: int,
                 num_window_blocks: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`num_window_blocks`: the windowed layers' pool (plus its null block), on models with one."""
    def cache(blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (blocks, block_size, spec.num_kv_heads, spec.head_dim)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    if num_window_blocks is None:
        return [cache(num_blocks) for _ in range(spec.num_layers)]
    return [cache(num_blocks if w is None else num_window_blocks + 1) for w in spec.layer_windows]
