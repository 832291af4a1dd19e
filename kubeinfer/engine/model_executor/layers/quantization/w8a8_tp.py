"""W8A8 under tensor parallelism, exact to one rank's numerics (w8a8.py installs, activations.py computes).

- Column-parallel layers (q/k/v, gate/up) see each token whole: their input is quantized as on one rank. Only
  the int8 `torch._int_mm` kernel needs this rank's rows of the checkpoint's per-channel weight scales
  (`rank_rows`), as the loader cut the weight's rows (linear.py `weight_pieces`).
- Row-parallel layers (o_proj, down_proj) see their slice of each token's columns:
  - static per-tensor scales are the same on every rank: exact locally;
  - dynamic per-token scales span the whole token: each rank takes its slice's min and max (with 0), one
    all-reduce MAX of [max, -min] over the group (`[2, tokens, 1]`, one small collective a layer, the same
    torch.distributed call as the partial sums' all-reduce, so captured in CUDA graphs alike) gives every
    rank the whole token's range, from which it quantizes its slice with the scale (and zero point) one rank
    would have computed: min and max are exact, so the result is bit for bit one rank's;
  - dynamic per-group scales (the fp8 method's blocks) are exact locally when the rank's columns start on a
    group boundary and end on one (or at the last column); a cut inside a group is refused by name (vLLM
    refuses block-fp8 cuts off the block as well)."""
from __future__ import annotations

import torch
from torch import nn

from ....distributed.parallel_state import all_reduce_max
from ..linear import ColumnParallelLinear, RowParallelLinear
from .activations import ActivationScheme
from .errors import QuantizationError


def is_split(layer: nn.Linear) -> bool:
    """Whether this rank holds part of the layer (a group of one holds all of it)."""
    if isinstance(layer, RowParallelLinear):
        return layer.tp_size > 1
    return any(p.size != p.total for p in getattr(layer, "parts", []))


def check(layer: nn.Linear, scheme: ActivationScheme, name: str) -> None:
    """Refuses, by name, the split layers whose activation quantization a rank cannot do exactly."""
    if not (isinstance(layer, RowParallelLinear) and layer.tp_size > 1 and scheme.strategy == "group"):
        return
    part, group = layer.input_part, scheme.group_size
    if part.start % group or (part.size % group and part.start + part.size != part.total):
        raise QuantizationError(
            f"{name}: with tensor_parallel_size {layer.tp_size} this rank holds input columns "
            f"[{part.start}, {part.start + part.size}) of {part.total}, which cut a group of {group} activation "
            f"columns ({scheme.describe()}); serve it with a tensor_parallel_size whose column slices are "
            f"multiples of {group} (or tensor_parallel_size 1)")


def range_reducer(layer: nn.Linear, scheme: ActivationScheme):
    """`reduce_range` for activations.dynamic_qparams where the layer's rank sees part of each token's range
    (a split row-parallel layer, per-token dynamic scales), else None."""
    if isinstance(layer, RowParallelLinear) and layer.tp_size > 1 and scheme.dynamic and scheme.strategy == "token":
        return whole_token_range
    return None


def whole_token_range(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's min and max of each token from each rank's (lo <= 0 <= hi): one MAX all-reduce of both."""
    both = all_reduce_max(torch.stack([hi, -lo]))
    return -both[1], both[0]


def rank_rows(layer: nn.Linear, scale: torch.Tensor | None, shard: int | None) -> torch.Tensor | None:
    """A column-parallel layer's checkpoint per-channel `scale` (of part `shard`, or of all parts fused in one
    tensor when None) cut to this rank's rows, as its weight was; any other scale as it is."""
    if scale is None or not isinstance(layer, ColumnParallelLinear) or not is_split(layer):
        return scale
    parts = layer.parts if shard is None else [layer.parts[shard]]
    if scale.numel() != sum(p.total for p in parts):
        return scale  # per tensor (or group): not an int_mm weight, w8a8._int8_weight says so
    rows = layer.weight_pieces(torch.empty(layer.out_features), scale.reshape(-1), shard)
    return torch.cat([source for _, source in rows])
