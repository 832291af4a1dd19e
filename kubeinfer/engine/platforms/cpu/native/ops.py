"""The torch-facing side of the native kernels (kernels.c): weight packing at load, and the products.

- `w8a8_linear`: int8 activations per token (activations.py's quantization, unchanged) times int8 weights per
  output channel: exact int32 sums, then the same two float32 scalings as activations.int8_linear, so the
  output equals torch._int_mm's bit for bit.
- `q8_0_linear`: llama.cpp's arithmetic for weight-only int8 / int4 weights (kernels_q8_0.c): the activations
  quantized per block of 32 as its Q8_0, each block's int32 sum scaled and accumulated in float32.

Every product's C entry point is given each buffer's length in bytes (a contiguous tensor's `nbytes`: numel times
the element size, from its data pointer on) and refuses dimensions that do not fit them (status EBOUNDS, nothing
written): `check` turns a status into NativeArgumentError / MemoryError.

Threads: a pool of KUBEINFER_CPU_NATIVE_THREADS (default: the CPUs this process may run on), the calling
thread one of them; after a call the workers spin KUBEINFER_CPU_NATIVE_SPIN_US microseconds (default 50)
for the next one, then sleep, so they do not hold the cores that OpenBLAS and torch use between calls."""
from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager

import torch

import kubeinfer.engine.envs as envs
from kubeinfer.engine.kernel_config import setting as kernel_setting
from ....model_executor.layers.quantization.activations import ActivationScheme, dynamic_qparams, quantize
from . import bindings, build
from .build import load

ROWS, BLOCK = 16, 32
MAX_INPUTS = 65536  # the W8A8 kernel's int32 sums of (w + 128) * x, |.| <= 255 * 128 * K, stay below 2**31
logger = logging.getLogger(__name__)
_state: dict = {}
_held = threading.local()  # .layers: layers_enabled()'s answer in this thread's step (layers_switch_held)
_UNREAD = object()  # in a step, before its first layers_enabled()
EBOUNDS = bindings.EBOUNDS  # kubeinfer_cpu.h's KI_EBOUNDS


class NativeArgumentError(ValueError):
    """A native product refused its arguments: its dimensions do not fit its buffers (nothing was written)."""


def check(status: int, name: str) -> None:
    """A native product's status as Python: 0 nothing, -1 MemoryError, EBOUNDS NativeArgumentError."""
    if status == 0:
        return
    if status == -1:
        raise MemoryError(f"native {name} kernel: out of memory")
    if status == EBOUNDS:
        raise NativeArgumentError(f"native {name} kernel: its dimensions do not fit its buffers (nothing written)")
    raise ValueError(f"native {name} kernel: status {status}")


def default_threads() -> int:
    wanted = envs.CPU_NATIVE_THREADS.get()
    if wanted is not None:
        return wanted
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# Each pointer followed by its buffer's length in bytes (the C side's argument checks); declared in bindings.py.
W8A8_SIGNATURE = bindings.SIGNATURES["ki_w8a8"]
QUANTIZE_TOKEN_SIGNATURE = bindings.SIGNATURES["ki_quantize_token_int8"]
PACKED_SIGNATURE = bindings.SIGNATURES["ki_q8_0_linear"]  # q8_0 and a16 linear


def quantize_token_int8(rows: torch.Tensor, q: torch.Tensor, sx: torch.Tensor) -> None:
    """ki_quantize_token_int8 of float32 contiguous rows [M, K] into q [M, K] int8 and sx [M] float32."""
    m, k = rows.shape
    check(kernel("ki_quantize_token_int8")(
        rows.data_ptr(), rows.nbytes, m, k, q.data_ptr(), q.nbytes, sx.data_ptr(), sx.nbytes), "int8 quantization")


def w8a8_into(q: torch.Tensor, sx: torch.Tensor, weight: int, weight_bytes: int, scale: int, scale_bytes: int,
              out: torch.Tensor) -> None:
    """ki_w8a8: q [M, K] int8 and sx [M] times the packed weight (by address, with its buffer's bytes) into
    float32 contiguous `out` [M, N]."""
    m, k = q.shape
    check(kernel("ki_w8a8")(q.data_ptr(), q.nbytes, sx.data_ptr(), sx.nbytes, m, k, weight,
                                             weight_bytes, scale, scale_bytes, out.shape[1], out.data_ptr(),
                                             out.nbytes), "W8A8")


def library():
    """The loaded library, or None (the reason logged once as a warning)."""
    if "lib" not in _state:
        lib, why = load()
        if lib is None and build.sanitizer():  # a sanitized run that silently used torch's kernels would prove nothing
            raise RuntimeError(f"KUBEINFER_CPU_NATIVE_SANITIZE is set but the sanitized library did not load: {why}")
        if lib is None:
            _state["why"] = why
            logger.warning("native CPU int8 kernels unavailable, using torch's: %s", why)
            _state["level"] = "torch"
        else:
            bindings.declare(lib)
            _state["level"] = build.loaded_level(lib)
            logger.info("native CPU kernels: level %s (%s)", _state["level"], build.chosen_level()[1])
            lib.ki_init(default_threads(), envs.CPU_NATIVE_SPIN_US.get())
        _state["lib"] = lib
    return _state["lib"]


def set_threads(threads: int) -> int:
    """The threads each product uses from now on (benchmarks); returns the count in use."""
    return library().ki_init(threads, -1)


def level() -> str | None:
    """The level of the library this process loaded (v4, v3, portable, native: build.py), "torch" where none
    loads (torch's kernels serve), None before the first product asked for it (nothing loaded yet)."""
    return _state.get("level")


def available() -> bool:
    return library() is not None


def load_failure() -> str:
    """Why the library did not load ("" where it did)."""
    library()
    return _state.get("why", "")


def layers_enabled() -> bool:
    """Whether a CPU model's non-matmul ops (decode attention, norms, activation, rotary) run through the native
    kernels, and with them whole decoder layers of a decode step (platforms/cpu/native_decode.py);
    the engine's cpu_native_layers False (KUBEINFER_CPU_NATIVE_LAYERS=0) keeps them in torch (default on, where
    the library is built). Read at every call, except inside `layers_switch_held` (an engine step): once there."""
    held = getattr(_held, "layers", None)
    if held is None:
        return _read_layers_switch()
    if held is _UNREAD:
        held = _held.layers = _read_layers_switch()
    return held


def _read_layers_switch() -> bool:
    return kernel_setting("cpu_native_layers") and available()


@contextmanager
def layers_switch_held():
    """Within (one engine step, on this thread): layers_enabled() reads the environment at its first call only. A
    batch-1 step asks ~60 times, each read of os.environ ~0.6 us; a switch flipped between steps is seen at the
    next step. Nothing is read (nor the library loaded) in a step that does not ask (the GPU path)."""
    previous = getattr(_held, "layers", None)
    _held.layers = _UNREAD
    try:
        yield
    finally:
        _held.layers = previous


def has_vnni() -> bool:
    lib = library()
    return bool(lib is not None and lib.ki_has_vnni())


def _padded_rows(t: torch.Tensor, fill) -> torch.Tensor:
    pad = -t.shape[0] % ROWS
    return t if not pad else torch.cat([t, torch.full((pad, *t.shape[1:]), fill, dtype=t.dtype)])


def pack_int8(values: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernels' layout (kernels.c): w + 128 as uint8, K zero-padded to a multiple of 32."""
    u = (values.to(torch.int16) + 128).to(torch.uint8)
    u = torch.nn.functional.pad(u, (0, -u.shape[1] % BLOCK), value=128)
    u = _padded_rows(u, 128)
    groups, cols = u.shape[0] // ROWS, u.shape[1]
    return u.view(groups, ROWS, cols // 4, 4).permute(0, 2, 1, 3).contiguous().flatten()


def unpack_int8(packed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """pack_int8's inverse: the int8 [rows, cols] weight (tests, inspection)."""
    padded = -(-cols // BLOCK) * BLOCK
    u = packed.view(-1, padded // 4, ROWS, 4).permute(0, 2, 1, 3).reshape(-1, padded)[:rows, :cols]
    return (u.to(torch.int16) - 128).to(torch.int8)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int4 values (int8 storage, [-8, 7]) [N, K], K a multiple of 32 -> w + 8, two per byte (kernels.c)."""
    u = _padded_rows((values.to(torch.int16) + 8).to(torch.uint8), 8)
    groups, cols = u.shape[0] // ROWS, u.shape[1]
    halves = u.view(groups, ROWS, cols // 8, 2, 4).permute(0, 2, 3, 1, 4)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).contiguous().flatten()


def pack_groups(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, groups] (scales or offsets per output row and weight group) -> [N / 16, groups, 16]."""
    t = _padded_rows(t.to(dtype), 0)
    return t.view(t.shape[0] // ROWS, ROWS, t.shape[1]).permute(0, 2, 1).contiguous()


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def w8a8_linear(x: torch.Tensor, scheme: ActivationScheme, packed: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, reduce_range=None) -> torch.Tensor:
    """activations.int8_linear through the native kernel: x [..., K] quantized per token exactly as there,
    `packed` from pack_int8, `weight_scale` [N] float32 (contiguous)."""
    shape = x.shape
    if shape[-1] > MAX_INPUTS:
        raise ValueError(f"native W8A8 kernel: {shape[-1]} inputs, at most {MAX_INPUTS} (int32 sums)")
    rows = x.reshape(-1, shape[-1])
    if reduce_range is None and rows.dtype == torch.float32:  # the same float32 operations in C (kernels.c)
        rows = rows.contiguous()
        q, sx = torch.empty(rows.shape, dtype=torch.int8), torch.empty(rows.shape[0])
        quantize_token_int8(rows, q, sx)
    else:
        scale, _ = dynamic_qparams(rows, scheme, reduce_range)
        q = quantize(rows, scale, None, scheme, dequantize=False).contiguous()
        sx = scale.to(torch.float32).reshape(-1).contiguous()
    out = torch.empty(rows.shape[0], weight_scale.shape[0], dtype=torch.float32)
    if rows.shape[0]:
        w8a8_into(q, sx, _ptr(packed), packed.nbytes, _ptr(weight_scale), weight_scale.nbytes, out)
    out = out.to(x.dtype).reshape(*shape[:-1], -1)
    return out if bias is None else out + bias


def q8_0_linear(x: torch.Tensor, packed: torch.Tensor, bits: int, scale: torch.Tensor, offset: torch.Tensor,
                group_size: int, out_features: int) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) times packed int8 / int4 weights in llama.cpp's arithmetic; `scale` and
    `offset` from pack_groups ([N / 16, groups, 16]); returns float32 [..., N]."""
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"llama.cpp's arithmetic needs inputs in blocks of {BLOCK}; got {k}")
    return packed_linear(_q8_0_kernel(), "Q8_0", x, packed, bits, scale, offset, group_size, out_features)


def packed_linear(kernel, name: str, x: torch.Tensor, packed: torch.Tensor, bits: int, scale: torch.Tensor,
                  zeros: torch.Tensor, group_size: int, out_features: int) -> torch.Tensor:
    """x [..., K] through a packed-int kernel of ki_q8_0_linear's arguments (ki_q8_0_linear, ki_a16_linear):
    float32 [..., N]. A decode step makes ~50 of these calls: no copy, view or check that is not needed
    (microseconds each)."""
    k = x.shape[-1]
    flat = x.dim() == 2
    rows = x if flat else x.reshape(-1, k)
    if rows.dtype is not torch.float32 or not rows.is_contiguous():
        rows = rows.to(torch.float32).contiguous()
    m = rows.shape[0]
    out = rows.new_empty(m, out_features)  # float32 CPU as rows: half torch.empty(..., dtype=)'s cost
    if m:
        groups = scale.shape[1]
        status = kernel(rows.data_ptr(), rows.nbytes, m, k, packed.data_ptr(), packed.nbytes, bits, scale.data_ptr(),
                        scale.nbytes, zeros.data_ptr(), zeros.nbytes, groups, k if groups == 1 else group_size,
                        out_features, out.data_ptr(), out.nbytes)
        if status != 0:
            check(status, name)
    return out if flat else out.view(*x.shape[:-1], out_features)


def kernel(name: str, argtypes: list | None = None, restype=None):
    """The library's function `name` with its ctypes signature set (bindings.py's unless given), looked up once
    per loaded library (_state: cleared with it); None where no library is built."""
    fn = _state.get(name)
    if fn is None:
        lib = library()
        if lib is None:
            return None
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = bindings.SIGNATURES[name] if argtypes is None else (argtypes, restype)
        _state[name] = fn
    return fn


def _q8_0_kernel():
    """ki_q8_0_linear, looked up once (library() and the attribute cost ~0.2 us a product)."""
    fn = _state.get("q8_0")
    if fn is None:
        fn = _state["q8_0"] = library().ki_q8_0_linear  # its signature set by library()
    return fn


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q int8 [M, K], d [M, K / 32] float16-rounded scales, per-block sums of q); tests."""
    x = x.to(torch.float32).contiguous()
    m, k = x.shape
    q, d, s = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // BLOCK), torch.empty(m, k // BLOCK,
                                                                                          dtype=torch.int32)
    library().ki_quantize_q8_0(_ptr(x), m, k, _ptr(q), _ptr(d), _ptr(s))
    return q, d, s
