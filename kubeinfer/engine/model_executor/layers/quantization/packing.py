"""Integers packed into int32 words, as the int4/int8 formats store them. Each format packs `32 // bits` values
per word, value j of a word at bits [j * bits, (j + 1) * bits) (little end first); they differ in which
axis they pack and in the order of the values inside a word (AWQ interleaves them)."""
from __future__ import annotations

import torch

from .errors import QuantizationError

# AWQ's GEMM layout: word nibble j holds column AWQ_ORDER[j] of its 8; unpacking reads column c from nibble
# AWQ_UNPACK[c] (AutoAWQ's published packing order).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_UNPACK = (0, 4, 1, 5, 2, 6, 3, 7)


def qweight_key(key: str) -> str:
    """The float weight an AutoAWQ/AutoGPTQ `*.qweight` tensor stands for (`*.weight`); other keys as they are."""
    return key[:-len("qweight")] + "weight" if key.endswith(".qweight") else key


def unpack_columns(packed: torch.Tensor, bits: int, columns: int | None = None) -> torch.Tensor:
    """[rows, words] int32 -> [rows, words * 32 // bits] unsigned values (int32), value j of a word at bits j*bits;
    `columns` cuts the padding of the last word."""
    if bits not in (2, 4, 8):
        raise QuantizationError(f"{bits}-bit values do not pack whole into int32 words; 2, 4 and 8 bits are served")
    if packed.dtype != torch.int32:
        raise QuantizationError(f"packed weights must be int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # arithmetic shift: the mask drops the sign
    values = values.reshape(packed.shape[0], -1)
    return values if columns is None else values[:, :columns]


def unpack_rows(packed: torch.Tensor, bits: int, rows: int | None = None) -> torch.Tensor:
    """[words, cols] int32 packed along the rows (GPTQ's qweight, compressed-tensors' zero points) -> [rows, cols]."""
    return unpack_columns(packed.t(), bits, rows).t()


def awq_unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM qweight/qzeros [rows, cols / 8] -> [rows, cols] 4-bit values in column order."""
    values = unpack_columns(packed, 4)
    rows, cols = values.shape
    order = torch.tensor(AWQ_UNPACK, device=packed.device)
    return values.view(rows, cols // 8, 8).index_select(2, order).reshape(rows, cols)
