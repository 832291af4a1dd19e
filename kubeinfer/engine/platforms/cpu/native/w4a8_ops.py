"""The torch-facing side of the native W4A8 product (w4a8_linear.c): int4 weights packed at load (half a byte a
weight, ops.pack_int4's layout) with one float32 scale per output row and group of input columns, and the
product of activations quantized per token as activations.py quantizes them (ops.w8a8_linear's quantization:
the same bits as compressed-tensors' fake quantization) with exact int32 sums per weight group:
out = sum over groups, in order, of fl(isum_g * fl(x_scale * w_scale_g)), float32, no fused multiply-add."""
from __future__ import annotations


import torch

from ....model_executor.layers.quantization.activations import ActivationScheme, dynamic_qparams, quantize
from . import ops


def takes(cols: int, groups: int, group_size: int) -> bool:
    """The layouts ki_w4a8 takes: one group of all inputs, or groups of a multiple of 32 inputs; inputs up to
    ops.MAX_INPUTS (its int32 sums)."""
    if cols > ops.MAX_INPUTS or groups < 1:
        return False
    return groups == 1 or (group_size % ops.BLOCK == 0 and -(-cols // group_size) == groups)


def pack(values: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 values [N, K] (int8 storage, [-8, 7]) and scales [N, groups] -> (packed weight, packed scales): the
    inputs zero-padded to a multiple of 32 (zero weights add nothing), rows to 16."""
    values = torch.nn.functional.pad(values, (0, -values.shape[1] % ops.BLOCK))
    return ops.pack_int4(values), ops.pack_groups(scale, torch.float32)


def quantized_tokens(rows: torch.Tensor, scheme: ActivationScheme, reduce_range=None):
    """(q int8 [M, K], x_scale float32 [M]) of rows [M, K] as activations.quantize gives them: in C where the
    library is built and the rows are float32 on one rank (ki_quantize_token_int8: the same float32 operations),
    else by activations.py itself."""
    if reduce_range is None and rows.dtype == torch.float32 and ops.available():
        rows = rows.contiguous()
        q, sx = torch.empty(rows.shape, dtype=torch.int8), torch.empty(rows.shape[0])
        ops.quantize_token_int8(rows, q, sx)
        return q, sx
    scale, _ = dynamic_qparams(rows, scheme, reduce_range)
    q = quantize(rows, scale, None, scheme, dequantize=False).contiguous()
    return q, scale.to(torch.float32).reshape(-1).contiguous()


# each pointer followed by its buffer's length in bytes (the C side's argument checks)


def _kernel():
    return ops.kernel("ki_w4a8")


def _float_kernel():
    return ops.kernel("ki_w4a8_f32")


def _checked(status: int, group_size: int, k: int) -> None:
    if status == -2:
        raise ValueError(f"native W4A8 kernel: groups of {group_size} over {k} inputs are not its layout")
    ops.check(status, "W4A8")


def linear(rows: torch.Tensor, scheme: ActivationScheme, packed: torch.Tensor, scale: torch.Tensor, group_size: int,
           out_features: int, reduce_range=None) -> torch.Tensor:
    """rows [M, K] quantized (quantized_tokens) and multiplied: float32 [M, out_features]. Float32 rows on one rank
    in one native call (ki_w4a8_f32: ki_quantize_token_int8, then ki_w4a8; a decode step makes ~50 of these)."""
    if reduce_range is not None or rows.dtype is not torch.float32:
        return product(*quantized_tokens(rows, scheme, reduce_range), packed, scale, group_size, out_features)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = rows.new_empty(rows.shape[0], out_features)
    linear_into(rows, packed.data_ptr(), packed.nbytes, scale.data_ptr(), scale.nbytes, scale.shape[1],
                group_size, out)
    return out


def linear_into(rows: torch.Tensor, packed: int, packed_bytes: int, scale: int, scale_bytes: int, groups: int,
                group_size: int, out: torch.Tensor) -> None:
    """`linear`'s native call on float32 contiguous rows [M, K] into float32 contiguous `out` [M, N], the packed
    weight and scales given by address and length in bytes (an expert's inside its layer's stack:
    fused_moe/a8_experts.py)."""
    m, k = rows.shape
    if m:
        _checked(_float_kernel()(rows.data_ptr(), rows.nbytes, m, k, packed, packed_bytes, scale, scale_bytes,
                                 groups, group_size, out.shape[1], out.data_ptr(), out.nbytes), group_size, k)


def product(q: torch.Tensor, sx: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int,
            out_features: int) -> torch.Tensor:
    """q [M, K] int8 (contiguous), sx [M] float32 times the packed weight -> float32 [M, out_features]."""
    m, k = q.shape
    out = torch.empty(m, out_features)
    if m:
        _checked(_kernel()(q.data_ptr(), q.nbytes, sx.data_ptr(), sx.nbytes, m, k, packed.data_ptr(),
                           packed.nbytes, scale.data_ptr(), scale.nbytes, scale.shape[1], group_size,
                           out_features, out.data_ptr(), out.nbytes), group_size, k)
    return out


def int_mm_product(q: torch.Tensor, sx: torch.Tensor, weight_t: torch.Tensor, scale_t: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """The same formula through torch._int_mm, one exact int32 product per weight group: q [M, K] int8, sx [M],
    weight_t int8 [K, N], scale_t float32 [groups, N] -> float32 [M, N], bit for bit the native kernel's."""
    sx = sx.reshape(-1, 1)
    out = torch.zeros(q.shape[0], weight_t.shape[1])
    for g in range(scale_t.shape[0]):
        cols = slice(g * group_size, min((g + 1) * group_size, q.shape[1]))
        isum = torch._int_mm(q[:, cols].contiguous(), weight_t[cols])
        out = out + isum.to(torch.float32) * (sx * scale_t[g])
    return out
