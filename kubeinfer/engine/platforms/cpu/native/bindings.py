"""Every exported function of the native library with its ctypes signature, declared once: kubeinfer_cpu.h is
the C side of the same list (tests/engine/test_cpu_native_header.py checks that both name the same functions
with the same number of arguments). A pointer is P; after each buffer its length in bytes (L), which the C side
checks the dimensions against (KI_EBOUNDS)."""
from __future__ import annotations

import ctypes

P, I, L, F, SIZE = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float, ctypes.c_size_t
EBOUNDS = -3  # kubeinfer_cpu.h's KI_EBOUNDS: a product's dimensions do not fit its buffers

_PACKED = [P, L, I, I, P, L, I, P, L, P, L, I, I, I, P, L]  # q8_0 and a16 linear: x, w, scale, offset/zero, out
SIGNATURES: dict[str, tuple[list, type | None]] = {
    # kernels.c
    "ki_has_vnni": ([], I),
    "ki_level": ([], I),
    "ki_init": ([I, L], I),
    "ki_w8a8": ([P, L, P, L, I, I, P, L, P, L, I, P, L], I),
    "ki_quantize_token_int8": ([P, L, I, I, P, L, P, L], I),
    # kernels_q8_0.c
    "ki_quantize_q8_0": ([P, I, I, P, P, P], None),
    "ki_q8_0_linear": (_PACKED, I),
    # a16_linear.c
    "ki_has_a16_bf16": ([], I),
    "ki_has_a16_vector": ([], I),
    "ki_a16_portable_calls": ([], L),
    "ki_a16_linear": (_PACKED, I),
    # w4a8_linear.c
    "ki_w4a8": ([P, L, P, L, I, I, P, L, P, L, I, I, I, P, L], I),
    "ki_w4a8_f32": ([P, L, I, I, P, L, P, L, I, I, I, P, L], I),
    # f32_linear.c
    "ki_f32_linear": ([P, L, I, I, P, L, I, P, L, I], I),
    "ki_f32_grouped_linear": ([P, L, I, I, P, L, I, I, P, L, P, L, I], I),
    # attention.c
    "ki_decode_attention": ([P, L, I, P, P, L, P, P, P, I, P, P, L, P, I, I, I, I, I, I, F, P], I),
    # decode_ops.c
    "ki_rms_norm": ([P, L, L, P, P, P, P, I, I, I, F, I], I),
    "ki_silu_mul": ([P, L, P, I, I], None),
    "ki_rotary": ([P, L, L, P, P, P, I, I, I, I], I),
    # decoder_layer.c
    "ki_round_to_cache": ([P, I, I, P], None),
    "ki_decoder_scratch_floats": ([P], SIZE),
    "ki_decoder_layers": ([P, I, P, P, I, I, P, P, P, P, I, P, L, P, P, L], I),
}


def declare(lib: ctypes.CDLL, names: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """Sets the signatures of `names` (default: all) on a loaded library; returns it."""
    for name in names or SIGNATURES:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = SIGNATURES[name]
    return lib
