"""Which attention backend a step runs: `torch` (any device) or `triton` (GPU kernels; the CPU only under
Triton's interpreter). Chosen once at start-up; the triton package is imported only when asked for."""
from __future__ import annotations

from collections.abc import Callable

import torch

from .attention import AttentionBackend, TorchAttentionBackend


def _triton_backend() -> AttentionBackend:
    try:  # optional: triton is in the `gpu` extra, and imported only when asked for
        from ...platforms.cuda.triton_attention import TritonAttentionBackend
    except ImportError as error:
        raise ValueError(f"the triton attention backend needs the triton package ({error}); install it with "
                         "pip install 'kubeinfer[gpu]', or use attention_backend='torch'") from None
    return TritonAttentionBackend()


ATTENTION_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": TorchAttentionBackend,
                                                                   "triton": _triton_backend}


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]()


def check_attention_backend(name: str, device: torch.device) -> str:
    """Fail at start-up, with what to do, when `name` cannot run on `device`; returns the name."""
    get_attention_backend(name)  # an unknown name, or triton not installed
    if name == "triton":
        # Imported here, as the kernels are: triton_utils reads TRITON_INTERPRET when first imported.
        from ...triton_utils import check_device
        check_device(device)
    return name
