"""The one check of a checkpoint's kept-quantized weights against the shapes the config implies, before anything
packs them for native code (the CPU's C products, the Triton kernels) or stacks them: the integer values
[rows, cols], the scales and zero points [rows, groups] with groups = ceil(cols / group_size) (a group size of at
least 1), their dtypes. A checkpoint is data from outside: a down_proj of [128, 64] where the config implies
[64, 64] once reached ki_a16_linear, which wrote 128 rows a token into buffers sized for 64 (issue 44). The dense
layers (model_loader._install_integers, the quantized lm_head among them) and the MoE experts
(expert_int_weights.ExpertIntegers) both call `check_int_weight`; a mismatch is a load-time ModelLoadError naming
the tensor, the shape the config implies and the shape found. The formats' own checks (compressed-tensors'
weight_shape and scale grids, GPTQ's g_idx and scales, AWQ's) run before this, as they read the tensors; the C
entry points check their own buffers again at every call (platforms/cpu/native/ops.py)."""
from __future__ import annotations

import torch

from .layers.quantization.linear_method import IntWeight
from .model_files import ModelLoadError


def check_int_weight(name: str, weight: IntWeight, rows: int | None, cols: int) -> None:
    """`weight` (one projection, or one expert's) against the config's [rows, cols]; rows None: any (a fused
    weight's slice, checked whole once its slices are joined). Raises ModelLoadError naming `name`."""
    values = weight.values
    found = tuple(values.shape)
    expected = (found[0] if rows is None and values.dim() == 2 else rows, cols)
    if values.dim() != 2 or found != expected:
        raise ModelLoadError(f"weight {name} has shape {found}, the config implies {expected}")
    wanted = (torch.float8_e4m3fn,) if weight.fp8 else (torch.int8,)
    if values.dtype not in wanted:
        raise ModelLoadError(f"weight {name} holds {values.dtype} values; its format gives {wanted[0]}")
    if not isinstance(weight.group_size, int) or weight.group_size < 1:
        raise ModelLoadError(f"weight {name} has a group size of {weight.group_size!r}; at least 1 input column")
    grid = (expected[0], -(-cols // weight.group_size))
    _check_grid(name, "scale", weight.scale, grid, weight.group_size)
    if weight.zero is not None:
        _check_grid(name, "zero point", weight.zero, grid, weight.group_size)
        if weight.zero.is_floating_point():
            raise ModelLoadError(f"the zero points of weight {name} are {weight.zero.dtype}, not integers")


def _check_grid(name: str, what: str, grid: torch.Tensor, expected: tuple[int, int], group_size: int) -> None:
    if tuple(grid.shape) != expected:
        raise ModelLoadError(f"the {what}s of weight {name} have shape {tuple(grid.shape)}, the config implies "
                             f"{expected} (one a row and group of {group_size} input columns)")


def check_experts(moe_name: str, moe, projection: str, key: str, weight: IntWeight) -> None:
    """One expert's checkpoint weight (`key`) of `projection` (gate_proj, up_proj, down_proj) against the
    FusedMoE's config: gate/up [intermediate, hidden], down [hidden, intermediate], the whole intermediate size
    (a tensor-parallel rank cuts its slice after)."""
    inter = moe.intermediate_size * moe.tp_size
    rows, cols = (moe.hidden_size, inter) if projection == "down_proj" else (inter, moe.hidden_size)
    check_int_weight(f"{key} ({moe_name} {projection})", weight, rows, cols)
