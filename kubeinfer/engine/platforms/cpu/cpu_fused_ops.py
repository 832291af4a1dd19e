"""Native CPU kernels for a decode step's small ops (platforms/cpu/native/decode_ops.c): RMSNorm with its residual add,
silu(gate) * up, and rotary embeddings in place. Each replaces 3-8 torch kernels with one pass over each row;
at batch 1 a step's ~100 such calls are most of its time outside the products.

Each function returns None where it does not apply (not a CPU tensor of a dtype it takes, a layout it does not
take, KUBEINFER_CPU_NATIVE_LAYERS=0, no compiler): the caller then runs its torch code. float32; the norm bf16 too
(rounded where torch rounds); other dtypes stay in torch. Accuracy (tests/engine/test_cpu_fused_ops.py): the residual
sum and the rotation are torch's bits; the norm and the activation within a few float32 ulps (sums and exp in
another order)."""
from __future__ import annotations


import torch

from .native import ops

MAX_BF16_NORM = 16384  # decode_ops.c's KI_NORM_MAX: a bf16 row is widened into a stack buffer


def _kernel(name: str):
    """The library's `name` with its signature (ops.kernel: looked up once per loaded library), or None where the
    native layers are off."""
    return ops.kernel(name) if ops.layers_enabled() else None


def _rows3(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[int, int, int, int, int] | None:
    """(T, H, N, token stride, head stride) of a [T, N] or [T, H, N] CPU tensor of `dtype` whose last dimension is
    contiguous; None otherwise. (A batch-1 step makes ~100 calls: every check here costs ~0.1 us.)"""
    if x.dtype is not dtype or not x.is_cpu or x.stride(-1) != 1:
        return None
    dim = x.dim()
    if dim == 2:
        t, n = x.shape
        return t, 1, n, x.stride(0), n
    if dim == 3:
        t, h, n = x.shape
        return t, h, n, x.stride(0), x.stride(1)
    return None


def _new(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor like x (empty_like: half torch.empty's cost, for a contiguous x)."""
    return torch.empty_like(x) if x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm.forward (weight * normalised) of x [T, N] or [T, H, N] (per-head norms, any token and head
    strides), float32 or bf16 (weight and residual of x's dtype): the normalised rows, or (normalised,
    x + residual) given `residual` (x's shape); both new tensors. None where it does not apply."""
    dtype = x.dtype
    if dtype is not torch.float32 and dtype is not torch.bfloat16:
        return None
    shape = _rows3(x, dtype)
    if (shape is None or weight.dtype is not dtype or weight.dim() != 1 or weight.shape[0] != shape[2]
            or not weight.is_contiguous() or (dtype is torch.bfloat16 and shape[2] > MAX_BF16_NORM)):
        return None
    if residual is not None and (residual.dtype is not dtype or residual.shape != x.shape
                                 or not residual.is_contiguous()):
        return None
    fn = _kernel("ki_rms_norm")
    if fn is None:
        return None
    t, h, n, st, sh = shape
    out = _new(x)
    if residual is None:
        if t:
            fn(x.data_ptr(), st, sh, None, None, weight.data_ptr(), out.data_ptr(), t, h, n, eps,
               dtype is torch.bfloat16)
        return out
    summed = torch.empty_like(residual)
    if t:
        fn(x.data_ptr(), st, sh, residual.data_ptr(), summed.data_ptr(), weight.data_ptr(),
           out.data_ptr(), t, h, n, eps, dtype is torch.bfloat16)
    return out, summed


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor | None:
    """silu(gate) * up of the fused projection's output [T, 2 * intermediate] (gate first): [T, intermediate]
    float32. None where it does not apply."""
    shape = _rows3(gate_up)
    if shape is None or gate_up.dim() != 2 or shape[2] != 2 * intermediate:
        return None
    fn = _kernel("ki_silu_mul")
    if fn is None:
        return None
    out = torch.empty((gate_up.shape[0], intermediate), dtype=torch.float32)
    if gate_up.shape[0]:
        fn(gate_up.data_ptr(), shape[3], out.data_ptr(), gate_up.shape[0], intermediate)
    return out


def rotate_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """RotaryEmbedding.rotate of x [T, heads, D] (any token and head strides) in place, the rotate-half layout;
    cos/sin [max_positions, D / 2] float32 (the module's tables), positions [T] int64. Returns x, or None where
    it does not apply (x untouched)."""
    shape = _rows3(x)
    if (shape is None or x.dim() != 3 or shape[2] % 2 or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or cos.shape != (cos.shape[0], shape[2] // 2) or sin.shape != cos.shape or not cos.is_contiguous()
            or not sin.is_contiguous() or not cos.is_cpu or positions.dtype is not torch.int64
            or positions.shape != (shape[0],) or not positions.is_contiguous() or not positions.is_cpu):
        return None
    fn = _kernel("ki_rotary")
    if fn is None:
        return None
    t, h, d, st, sh = shape
    if h > 1 and sh < d or t > 1 and st < h * sh:  # overlapping heads or tokens: in place would be wrong
        return None
    if t and fn(x.data_ptr(), st, sh, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                  cos.shape[0], t, h, d) != 0:
        raise IndexError(f"rotary: a position outside [0, {cos.shape[0]}) (the model's max positions)")
    return x
