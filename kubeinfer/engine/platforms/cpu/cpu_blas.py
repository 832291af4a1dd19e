"""Projections of small steps on the CPU through OpenBLAS (numpy's), which streams the weights at nearly
the machine's read bandwidth where torch's MKL/oneDNN paths do not.

Measured here (benchmarks/bench_cpu_gemv.py, float32, a whole step's products of the benchmark model,
2 threads): one token 2.5 ms with OpenBLAS against 4.9 ms for torch's best layout (column-major) and
7.6 ms for the checkpoint's; 16 tokens 10.2 against 13.2-14.1 ms; 64 tokens 22.1 against 32.5-33.6 ms.
Whole engine at batch 1 (bench_decode_roofline.py): 178.7 against 129.6 tok/s.

Two thread pools cannot share two cores: while OpenBLAS runs, torch's OpenMP workers spin-wait, and the
step ran 12x slower. So a small step (decodes, drafts to verify, a short prompt chunk: at most
MAX_STEP_TOKENS tokens) runs torch on one thread (its small per-layer ops gain nothing from more) and
hands each projection to OpenBLAS, which uses every core. Attention is what one torch thread cannot
carry: larger steps, and steps over more than MAX_CONTEXT_TOKENS tokens of context in all, keep
torch's threads and its own matmuls (48 sequences at ~200 tokens ran 15% slower through OpenBLAS; at
~60 tokens, 17% faster), except a decode step whose every layer's attention runs in C on the native pool
(the fused call or the per-module path's native attention: native_decode.decode_attention_native), small whatever
its context (a float32 model at batch 16 and 256-token prompts: 1.9x tok/s; RESULTS "long-context-f32-steps").
Only float32 (numpy has no bfloat16).

Torch's part of a small step may use the second core without a second pool (two_cores.py: int products
and the decode attention of 4+ sequences in two halves, the second on a helper thread that sleeps between
them), in models with kept-int projections; it is on by default only where OpenBLAS's idle workers stop
spinning promptly (OPENBLAS_THREAD_TIMEOUT; two_cores.py says what was measured). A float32 model's
projections all wake OpenBLAS's worker, and sharing its attention was 0.93-0.97x: not shared. Torch's two
threads for a W8A16 model's whole step instead (lm_head through torch, KUBEINFER_CPU_OPENBLAS=0) were 1.25x
(batch 1) and 1.5x (16) faster than one thread at load ~1, but 20-30x slower in rounds where other jobs held
a core (a barrier waits for a descheduled worker); with OpenBLAS on both cores for lm_head as well (two
pools), 1.35-1.55x slower than one thread.
Steps of 2-16 tokens (and any KUBEINFER_CPU_NATIVE_LAYERS step's lm_head, native_lm_head.py) take the native
float32 product instead, on the native kernels' pool (platforms/cpu/native/f32_linear.c), where the library
builds and KUBEINFER_CPU_NATIVE_LAYERS is on: per call at 2 / 4 / 16 tokens it was 4.6 / 3.2 / 1.9x faster than
OpenBLAS on the qkv product of the 222M benchmark model and 3.5 / 3.3 / 0.95x on gate_up, while one token (a
read of the weights, 49 against OpenBLAS's 56 GB/s) and 32+ tokens (OpenBLAS's blocked gemm, 1.3-2x) stay on
OpenBLAS; whole engine, float32, batch 16 1.47x tok/s, batch 1 unchanged (benchmarks/bench_f32_linear.py
--engine --layers, load 1.4-1.8; RESULTS "native-f32-linear").
`KUBEINFER_CPU_OPENBLAS=0` turns the OpenBLAS path off; `KUBEINFER_CPU_OPENBLAS_MAX_CONTEXT` moves the bound;
`KUBEINFER_CPU_SHARE_CORES` (auto, 1, 0): two_cores.py.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

import kubeinfer.engine.envs as envs
from kubeinfer.engine.kernel_config import setting as kernel_setting
from . import two_cores
from .native import f32_ops

# Per thread, as torch's thread count is (OpenMP keeps it per thread): engines stepping on two threads
# of one process do not change each other's.
_step = threading.local()  # .active: this thread is in a small step
MAX_CONTEXT_TOKENS = envs.CPU_OPENBLAS_MAX_CONTEXT.get()
MAX_STEP_TOKENS = 256  # tokens computed in the step (decodes, drafts, a short chunk): OpenBLAS wins to 64 and past
# ... except at 2-16 tokens, where the native float32 product (f32_linear.c, both cores) beats OpenBLAS's gemm
NATIVE_MAX_TOKENS = 16


def use_openblas_for_small_steps(model: nn.Module) -> bool:
    """Route the float32 CPU nn.Linear layers of `model` through OpenBLAS during small steps; whether it did."""
    if not kernel_setting("cpu_openblas"):  # the engine's (KUBEINFER_CPU_OPENBLAS)
        return False
    layers = [m for m in model.modules() if isinstance(m, nn.Linear) and not hasattr(m, "quant_method")
              and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]  # quant methods run their own
    for layer in layers:
        layer.forward = _openblas_forward(layer, layer.forward)
    return bool(layers)


def _openblas_forward(layer: nn.Linear, torch_forward):
    seen = [None, 0, None]  # the weight tensor, its data pointer, its transposed numpy view
    params = layer._parameters  # not Module.__getattr__ (~0.4 us a name): a float32 decode step makes ~85 products

    def weight_t() -> np.ndarray:
        # The loader and LoRA may swap the tensor or its storage: look again when either changed (a view
        # shares memory, so writes in place are seen without it).
        weight = params["weight"]
        if weight is not seen[0] or weight.data_ptr() != seen[1]:
            seen[:] = weight, weight.data_ptr(), weight.detach().numpy().T
        return seen[2]

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not getattr(_step, "active", False) or x.dtype != torch.float32 or x.requires_grad:
            return torch_forward(x)
        weight = params["weight"]
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if 2 <= rows <= NATIVE_MAX_TOKENS and f32_ops.wants(x) and f32_ops.supports(weight):
            out = f32_ops.f32_linear(x, weight)  # 2-16 tokens: OpenBLAS's small gemm is 1.3-9x slower here
        else:
            out = torch.from_numpy(np.matmul(x.numpy(), weight_t()))
        bias = params["bias"]
        return out if bias is None else out.add_(bias)
    return forward


def in_small_step() -> bool:
    """Whether this thread is in a small step (torch on one thread: a native kernel's pool may take the cores)."""
    return getattr(_step, "active", False)


@contextmanager
def small_step(enabled: bool, share_cores: bool = False):
    """Within: projections go to OpenBLAS and torch runs on one thread (see the module docstring); `share_cores`:
    a model with kept-int projections, whose torch work may take the second core (two_cores.py)."""
    if not enabled:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _step.active = True
    two_cores.sharing(share_cores and threads > 1)  # int products and attention in halves, where enabled
    try:
        yield
    finally:
        _step.active = False
        two_cores.sharing(False)
        torch.set_num_threads(threads)
