"""Int8/int4 checkpoint weights kept quantized (layers/quantization/linear_method.py) as the loader reads
them: the format's integers, scales and zeros (its `int_weight`), cut to this tensor-parallel rank's slice
where the layer's own `weight_pieces` asks, as a float weight is: column-parallel layers keep their output
rows part by part (q/k/v, gate/up), row-parallel ones their input columns. Each part is read from the file
alone where the format can cut its packed tensors there (`checkpoint_slice`: on word and group boundaries);
elsewhere the packed tensor is unpacked whole and cut (IntWeight.narrow, which regroups a cut inside a
group exactly). Each rank keeps only its slice. A quantized LM head (a checkpoint whose lm_head is quantized) is cut
by vocabulary rows, as its float weight is (vocab_parallel.py): a per-row or grouped-along-the-inputs scale cuts
with its rows; the last rank's padding rows past the vocabulary are zero weights (their logits are dropped)."""
from __future__ import annotations

import torch
from torch import nn

from .layers.linear import ColumnParallelLinear, RowParallelLinear
from .layers.quantization.linear_method import IntWeight
from .layers.vocab_parallel import ParallelLMHead


def rank_int_weight(quantization, key: str, f, get, module: nn.Module, param, shard: int | None,
                    split: bool) -> IntWeight | None:
    """`key`'s weight as integers, this rank's slice when `split`; None where the format dequantizes it
    (act-order g_idx, FP8, block scales), or where a split layer is not a parallel linear or the LM head.
    Raises the format's QuantizationError on a broken checkpoint."""
    if not split:
        return quantization.int_weight(key, f.get_tensor(key), get)
    if isinstance(module, ParallelLMHead) and param is module.weight:
        return _vocab_rows(quantization, key, f, get, module)
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


def _vocab_rows(quantization, key: str, f, get, head: ParallelLMHead) -> IntWeight | None:
    """This rank's rows of a quantized LM head [vocab, hidden], padded with zero rows to the head's row count."""
    rows = head.weight.shape[0]
    held = max(0, min(rows, head.vocab_size - head.start))
    part = quantization.checkpoint_slice(key, f.get_slice(key), get, 0, head.start, held) \
        if hasattr(quantization, "checkpoint_slice") and held else None
    if part is not None:
        piece = quantization.int_weight(key, *part)
    else:
        whole = quantization.int_weight(key, f.get_tensor(key), get)
        piece = None if whole is None else whole.narrow(0, head.start, held)
    if piece is None or held == rows:
        return piece
    pad = rows - held  # ones as scales: no kernel meets a zero scale; zero values give zero logits anyway

    def grow(t, fill):
        return None if t is None else torch.cat([t, torch.full((pad, *t.shape[1:]), fill, dtype=t.dtype)])
    values = piece.values.view(torch.uint8) if piece.fp8 else piece.values
    return IntWeight(grow(values, 0).view(piece.values.dtype), grow(piece.scale, 1.0), grow(piece.zero, 0),
                     piece.group_size, piece.bits, piece.fp8)


class _Cuts:
    """Stands for the checkpoint tensor in `weight_pieces`: records the (dim, start, length) cuts it asks for."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int, int]] = []

    def narrow(self, dim: int, start: int, length: int) -> None:
        self.asked.append((dim, start, length))
