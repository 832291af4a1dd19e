"""Int8/int4 checkpoint weights kept quantized (layers/quantization/linear_method.py) as the loader reads
them: the format's integers, scales and zeros (its `int_weight`), cut to this tensor-parallel rank's slice
where the layer's own `weight_pieces` asks, as a float weight is: column-parallel layers keep their output
rows part by part (q/k/v, gate/up), row-parallel ones their input columns. Each part is read from the file
alone where the format can cut its packed tensors there (`checkpoint_slice`: on word and group boundaries);
elsewhere the packed tensor is unpacked whole and cut (IntWeight.narrow, which regroups a cut inside a
group exactly). Each rank keeps only its slice."""
from __future__ import annotations

from torch import nn

from .layers.linear import ColumnParallelLinear, RowParallelLinear
from .layers.quantization.linear_method import IntWeight


def rank_int_weight(quantization, key: str, f, get, module: nn.Module, param, shard: int | None,
                    split: bool) -> IntWeight | None:
    """`key`'s weight as integers, this rank's slice when `split`; None where the format dequantizes it
    (act-order g_idx, FP8, block scales), or where a split layer is not a parallel linear (a quantized LM
    head: dequantized whole, then cut by vocabulary). Raises the format's QuantizationError on a broken
    checkpoint."""
    if not split:
        return quantization.int_weight(key, f.get_tensor(key), get)
    if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or param is not module.weight:
        return None  # a bias: float, read as it is
    cuts = _Cuts()
    module.weight_pieces(param, cuts, shard)
    whole, pieces = None, []
    for dim, start, length in cuts.asked:
        part = quantization.checkpoint_slice(key, f.get_slice(key), get, dim, start, length) \
            if hasattr(quantization, "checkpoint_slice") else None
        if part is not None:
            piece = quantization.int_weight(key, *part)
        else:
            whole = whole or quantization.int_weight(key, f.get_tensor(key), get)
            piece = None if whole is None else whole.narrow(dim, start, length)
        if piece is None:
            return None
        pieces.append(piece)
    return pieces[0] if len(pieces) == 1 else IntWeight.cat(pieces)


class _Cuts:
    """Stands for the checkpoint tensor in `weight_pieces`: records the (dim, start, length) cuts it asks for."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int, int]] = []

    def narrow(self, dim: int, start: int, length: int) -> None:
        self.asked.append((dim, start, length))
