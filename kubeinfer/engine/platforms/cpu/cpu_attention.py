"""Decode attention on the CPU through the native kernels (platforms/cpu/native/attention.c).

A step's decode rows attend in one C call per layer: each (sequence, KV head) pair on the kernels' thread pool
reads its context in place through the block table (no gather of the context, no mask), softmax in float32. It
replaces the torch path's gathers, SDPA and two_cores split for decodes when `ops.layers_enabled()` (the library
is built and KUBEINFER_CPU_NATIVE_LAYERS is not 0) and the case is one it computes: queries in float32 or
bfloat16, a float32, bfloat16 or fp8 (e4m3 / e5m2: a table of each byte's value, or with AVX-512 bit arithmetic
to the same values, so widened as torch widens it) cache, no softcap, no sinks. Anything else keeps the torch path
(attention.py).

In a step of decodes only, the same call first writes the step's K/V rows into their slots (the two
index_copy_ of write_kv_cache): the rows are cast to the cache's type by the same function first
(to_cache_dtype: fp8 saturation included), so the cache holds the same bytes."""
from __future__ import annotations


import torch

from .native import ops
from ...model_executor.layers.quantization.kv_cache_dtype import to_cache_dtype

CACHE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}  # attention.c's
QUERY_TYPES = (torch.float32, torch.bfloat16)
_state: dict = {}


def usable(q: torch.Tensor, k_cache: torch.Tensor, meta, softcap, sinks) -> bool:
    """Whether this layer's decode rows go through the native kernel (the cheap checks first: every layer asks)."""
    return (meta.num_decodes > 0 and not softcap and sinks is None and q.device.type == "cpu"
            and q.dtype in QUERY_TYPES and k_cache.dtype in CACHE_KINDS and ops.layers_enabled())


def _kernel():
    return ops.kernel("ki_decode_attention")  # bindings.py's signature


def byte_values(dtype: torch.dtype) -> torch.Tensor:
    """[256] float32: the value of each byte of a one-byte cache type (its exact widening)."""
    if dtype not in _state:
        _state[dtype] = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32)
    return _state[dtype]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[N, heads, D] with heads D apart and elements adjacent (rows may be strided: q and k are views of qkv)."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
           new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """[B, H, D] attention of the first B = q.shape[0] sequences of `meta` (all decodes) over their cached
    context; `new_kv` (k, v) [B, Hkv, D]: written into their slots (meta.slot_mapping) first."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or heads % kv_heads or v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape:
        raise ValueError(f"native decode attention: q {tuple(q.shape)} against caches {tuple(k_cache.shape)} "
                         f"{k_cache.dtype} / {tuple(v_cache.shape)} {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("native decode attention: the KV cache must be contiguous")
    tables, lens = meta.block_tables, meta.context_lens_tensor
    if tables.dtype != torch.long or lens.dtype != torch.long or tables.stride(1) != 1 or not lens.is_contiguous():
        raise ValueError("native decode attention: block tables and context lengths must be int64, rows contiguous")
    q = _rows(q)
    k = v = slots = None
    kv_stride = 0
    if new_kv is not None:
        k, v = new_kv
        if k.dtype != k_cache.dtype:
            k, v = to_cache_dtype(k, k_cache.dtype), to_cache_dtype(v, v_cache.dtype)
        k, v = _rows(k), _rows(v)
        if k.stride(0) != v.stride(0):
            k, v = k.contiguous(), v.contiguous()
        kv_stride, slots = k.stride(0), meta.slot_mapping
        if slots.dtype != torch.long or not slots.is_contiguous() or k.shape[0] != batch:
            raise ValueError("native decode attention: one int64 slot per new K/V row")
    kind = CACHE_KINDS[k_cache.dtype]
    lut = byte_values(k_cache.dtype) if kind >= 2 else None
    out = torch.empty(batch, heads, head_dim, dtype=q.dtype)
    window = meta.sliding_window or 0
    status = _kernel()(q.data_ptr(), q.stride(0), int(q.dtype == torch.bfloat16),
                       None if k is None else k.data_ptr(), None if v is None else v.data_ptr(), kv_stride,
                       None if slots is None else slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kind,
                       None if lut is None else lut.data_ptr(), tables.data_ptr(), tables.stride(0),
                       lens.data_ptr(), batch, heads, kv_heads, head_dim, block_size, window, scale, out.data_ptr())
    if status != 0:
        raise MemoryError("native decode attention: out of memory")
    return out
