"""Int8/int4 checkpoint weights kept quantized (layers/quantization/linear_method.py) as the loader reads
them: the format's integers, scales and zeros (its `int_weight`), cut to this tensor-parallel rank's slice
by the layer's own `weight_pieces`, as a float weight would be: column-parallel layers keep their output
rows part by part (q/k/v, gate/up), row-parallel ones their input columns (regrouped exactly where the cut
is not on a group boundary, IntWeight.narrow). Each rank keeps only its slice; the packed tensor is unpacked
whole, one tensor at a time, and dropped."""
from __future__ import annotations

from torch import nn

from .layers.linear import ColumnParallelLinear, RowParallelLinear
from .layers.quantization.linear_method import IntWeight


def rank_int_weight(quantization, key: str, tensor, get, module: nn.Module, param, shard: int | None,
                    split: bool) -> IntWeight | None:
    """`key`'s weight as integers, this rank's slice when `split`; None where the format dequantizes it
    (act-order g_idx, FP8, block scales), or where a split layer is not a parallel linear (a quantized LM
    head: dequantized whole, then cut by vocabulary). Raises the format's QuantizationError on a broken
    checkpoint."""
    if split and not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return None
    whole = quantization.int_weight(key, tensor, get)
    if whole is None or not split:
        return whole
    pieces = [piece for _, piece in module.weight_pieces(param, whole, shard)]
    return pieces[0] if len(pieces) == 1 else IntWeight.cat(pieces)
