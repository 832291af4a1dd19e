"""The ctypes side of platforms/cpu/native/decoder_layer.c: whole decoder layers of a CPU decode step in one C call.

`Layers` holds a run of consecutive layers' descriptors (their weights' pointers, prepared once; the tensors kept
alive here) and the step's scratch (grown to the largest batch seen, reused). `Layers.run` takes only the step's
pointers: the input and residual, positions, each layer's K/V caches and the step's metadata per window. The caches
are float32, bfloat16 or fp8 (e4m3 / e5m2), all of one type; the C side rounds the step's K/V rows to it as
kv_cache_dtype.to_cache_dtype does. Which layers qualify, and when a step may take this path, is
platforms/cpu/native_decode.py's business."""
from __future__ import annotations

import ctypes

import torch

from .cpu_attention import CACHE_KINDS, byte_values
from .native import ops
from .native.a16_method import A16Method
from ...model_executor.layers.quantization.w4a8 import W4A8Method

P, INT, LONG, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
CACHE_TYPES = CACHE_KINDS  # decoder_layer.c's cache types: ki_decode_attention's kinds


class Proj(ctypes.Structure):
    _fields_ = [("w", P), ("scale", P), ("bias", P), ("offset", P), ("bits", INT), ("groups", INT), ("group_size", INT),
                ("N", INT), ("K", INT), ("a16", INT),  # then the buffers' bytes, which the C side checks against
                ("w_bytes", LONG), ("scale_bytes", LONG), ("bias_bytes", LONG), ("offset_bytes", LONG)]


class View(ctypes.Structure):
    _fields_ = [("slots", P), ("tables", P), ("lens", P), ("table_stride", LONG), ("window", INT)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", Proj), ("o", Proj), ("gate_up", Proj), ("down", Proj), ("in_norm", P), ("post_norm", P),
                ("q_norm", P), ("k_norm", P), ("cos", P), ("sin", P), ("in_eps", F), ("post_eps", F), ("q_eps", F),
                ("k_eps", F), ("scale", F), ("H", INT), ("Hkv", INT), ("D", INT), ("hidden", INT), ("inter", INT),
                ("max_positions", INT), ("view", INT)]


def _kernel(name: str):
    """The library's `name` with its signature (ops.kernel: looked up once per loaded library)."""
    return ops.kernel(name)  # bindings.py's signature


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.nbytes


def proj(linear: torch.nn.Linear, keep: list) -> Proj:
    """A projection multiplied by NativeIntMethod (its packed weight, scales, offsets and bias), A16Method (zeros
    in place of the offsets) or W4A8Method (the native w4a8_vnni kernel, no offsets), as its apply."""
    method, params = linear.quant_method, linear._parameters
    if type(method) is W4A8Method:  # its packed int4 and group scales, no offsets (ki_w4a8_f32)
        tensors = [params["qweight_int4"], params["weight_group_scale"], params.get("bias")]
        keep.extend(tensors)
        return Proj(_ptr(tensors[0]), _ptr(tensors[1]), _ptr(tensors[2]), None, 4, tensors[1].shape[1],
                    method.group_size, method.out_features, linear.in_features, 2, *map(_bytes, tensors), 0)
    a16 = type(method) is A16Method
    tensors = [params["qweight"], params["weight_scale"], params[method.zero_name], params.get("bias")]
    keep.extend(tensors)
    groups = tensors[1].shape[1]
    return Proj(_ptr(tensors[0]), _ptr(tensors[1]), _ptr(tensors[3]), _ptr(tensors[2]), method.bits, groups,
                method.group_size, method.out_features, linear.in_features, int(a16),
                *(_bytes(tensors[i]) for i in (0, 1, 3, 2)))


class Layers:
    """Consecutive decoder layers run by one ki_decoder_layers call; `descriptors` from `proj` and Layer(...)."""

    def __init__(self, descriptors: list[Layer], views: list[int | None], keep: list) -> None:
        """views: the attention window of each view index the descriptors name (None: the model's own)."""
        self.count = len(descriptors)
        self.layers = (Layer * self.count)(*descriptors)
        self.windows = views
        self.keep = keep  # the tensors whose pointers the descriptors hold
        self.kv_shapes = [(d.Hkv, d.D) for d in descriptors]  # what each layer's caches must hold
        self.row_floats = max(_kernel("ki_decoder_scratch_floats")(ctypes.byref(d)) for d in descriptors)
        self.scratch = torch.empty(0)
        self._caches_key = None
        self._view_array = (View * len(views))()

    def caches(self, kv_caches: list, first: int) -> tuple | None:
        """(pointer array, block size, cache type, byte values or None) of this run's caches, or None where one is
        not a contiguous [blocks, block size, Hkv, D] cache of one of CACHE_TYPES, the run's caches all of one;
        rebuilt only when the list or its first tensor changes (the engine keeps one list)."""
        key = (id(kv_caches), kv_caches[first][0].data_ptr())
        if key != self._caches_key:
            pairs = kv_caches[first:first + self.count]
            block, dtype = pairs[0][0].shape[1], pairs[0][0].dtype
            if dtype not in CACHE_TYPES or any(
                   c.dtype != dtype or not c.is_contiguous() or c.dim() != 4 or c.shape[1] != block
                   or tuple(c.shape[2:]) != shape or not c.is_cpu
                   for p, shape in zip(pairs, self.kv_shapes) for c in p):
                return None
            lut = byte_values(dtype) if dtype.itemsize == 1 else None
            self._caches = ((P * (2 * self.count))(*(c.data_ptr() for p in pairs for c in p)), block,
                            CACHE_TYPES[dtype], lut)
            self._caches_key = key
        return self._caches

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, caches: tuple,
            metas: list) -> tuple[torch.Tensor, torch.Tensor]:
        """This run's layers over a decode step: x [T, hidden] float32 contiguous, residual like it or None;
        metas: the step's AttentionMetadata for each of self.windows (int64 tables, lengths and slots)."""
        x = x.contiguous()  # (a no-op for the embeddings and the layers' outputs)
        residual = None if residual is None else residual.contiguous()
        tokens = x.shape[0]
        need = tokens * self.row_floats + 16
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need)
        base = self.scratch.data_ptr()
        base += -base % 64
        scratch_bytes = self.scratch.nbytes - (base - self.scratch.data_ptr())
        views = self._view_array
        for view, meta in zip(views, metas):
            tables = meta.block_tables
            view.slots, view.tables, view.lens = (meta.slot_mapping.data_ptr(), tables.data_ptr(),
                                                  meta.context_lens_tensor.data_ptr())
            view.table_stride, view.window = tables.stride(0), meta.sliding_window or 0
        x_out, res_out = torch.empty_like(x), torch.empty_like(x)
        layers_fn = _kernel("ki_decoder_layers")
        status = layers_fn(self.layers, self.count, views, caches[0], caches[1], caches[2], _ptr(caches[3]),
                           x.data_ptr(), _ptr(residual), positions.data_ptr(), tokens, base, scratch_bytes,
                           x_out.data_ptr(), res_out.data_ptr(), x.nbytes)
        if status == -2:
            raise IndexError("rotary: a position outside the model's max positions")
        ops.check(status, "decoder layers")
        return x_out, res_out
