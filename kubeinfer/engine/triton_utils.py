"""What every Triton kernel of the engine shares: whether kernels run in Triton's CPU interpreter, and
the rules that follow from it and from the GPU's tensor cores. Torch only; triton itself is not imported.
Import it only where the kernels are imported (lazily, when the triton backend is chosen): it reads
TRITON_INTERPRET once, at import, as Triton does when it decorates the kernels."""
from __future__ import annotations

import os

import torch

# Read when the kernels are decorated (at import), exactly as Triton does: setting it later changes nothing.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
MIN_DOT = 16  # tl.dot needs every dimension >= 16 on a GPU


def must_upcast(t: torch.Tensor) -> bool:
    """Whether a kernel must widen loads to fp32: always off the GPU, and for fp32 tensors (exact dots)."""
    return INTERPRETED or t.device.type != "cuda" or t.dtype == torch.float32


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def check_device(device: torch.device, what: str = "the triton attention backend",
                 instead: str = "attention_backend='torch' (--attention-backend torch)") -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors only under the interpreter (compiled, they fail at
    the first launch: "Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")."""
    if device.type == "cpu" and not INTERPRETED:
        raise ValueError(f"{what} needs a CUDA device; on the CPU use {instead}, or set TRITON_INTERPRET=1 before "
                         "starting to run the kernels in Triton's interpreter (slow: for tests)")


def group_tile(group_size: int, k: int, widest: int = 64) -> tuple[int, bool]:
    """(BLOCK_K, whether every K tile lies inside one quantization group) for a kernel that dequantizes weights
    held by groups of `group_size` input columns (all K: per channel). Inside one group the kernel multiplies
    the exact integers (q - zero; e4m3 values) and scales the tile's fp32 sums: a bf16 / fp16 dot never sees a
    scaled weight rounded to 8 / 11 bits. The tile: the widest power of two up to `widest` dividing the group
    (any, for a single group); below MIN_DOT, tiles span groups and the weight is scaled before the dot."""
    if group_size >= k:
        return max(MIN_DOT, min(widest, _next_power_of_2(k))), True
    divides = min(widest, group_size & -group_size)  # the lowest set bit: the largest power of two dividing it
    if divides >= MIN_DOT:
        return divides, True
    return max(MIN_DOT, min(widest, _next_power_of_2(group_size))), False


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
