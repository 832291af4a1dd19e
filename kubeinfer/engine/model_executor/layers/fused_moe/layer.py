"""The experts of one MoE layer, whatever the checkpoint's layout, stacked in two tensors:
gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows) and down_proj [E, H, I], plus biases
where the family has them (gpt-oss). `forward` takes the router's choice and returns the weighted sum of
each token's experts: grouped by expert in torch on the CPU (grouped.py), the fused Triton kernels on a GPU
(triton_moe.py).

Tensor parallelism: with tp_size > 1 each rank holds every expert's slice [rank * I/tp, (rank + 1) * I/tp)
of the intermediate dimension, so its output is a partial sum the caller all-reduces; the down bias is held
by rank 0 alone, so that the sum counts it once. The load_* methods slice full checkpoint tensors.

Quantized checkpoints' experts are kept as integers (or fp8) where a kernel serves them: `int_method`
(int_experts.py, installed by the loader) then holds them and multiplies, and the float stacks are shapes on the
meta device. Elsewhere they reach these methods dequantized (the loader reads each expert's tensor through its
format) and are held as float. `weight_transform`, when
set, maps each full weight in our [..., out, in] orientation before it is sliced and stored
(--quantization fp8 on a float checkpoint where its experts are not kept e4m3, e.g. on a CPU: the per-channel
round trip, before TP's slice, as for a dense layer).
`input_quant` (expert_input_quant.py), when set, quantizes the experts' inputs as W8A8 checkpoints define them.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .activation import clamped_swiglu, silu_and_mul
from .grouped import grouped_experts


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, bias: bool = False,
                 swiglu_limit: float | None = None, swiglu_alpha: float = 1.702, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        """swiglu_limit: gpt-oss's clamped SwiGLU; None: SiLU(gate) * up."""
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"the experts' intermediate size {intermediate_size} does not split over "
                             f"{tp_size} tensor-parallel ranks")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.intermediate_size = intermediate_size // tp_size  # this rank's slice
        inter = self.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inter), requires_grad=False)
        self.gate_up_proj_bias = _parameter(num_experts, 2 * inter) if bias else None
        self.down_proj_bias = _parameter(num_experts, hidden_size) if bias else None
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
        self.activation = silu_and_mul if swiglu_limit is None else clamped_swiglu(swiglu_alpha, swiglu_limit)
        self.fused = False  # the Triton kernels (set by the model's use_triton_kernels)
        self.weight_transform: Callable[[torch.Tensor, str], torch.Tensor] | None = None
        self.input_quant = None  # an ExpertInputQuant (set by layers/quantization/w8a8_experts.py)
        self.int_method = None  # kept-quantized experts (int_experts.py), set by the loader

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_weights, topk_ids [T, k] -> [T, H] (this rank's partial sum under TP)."""
        if self.int_method is not None:
            return self.int_method.apply(self, x, topk_weights, topk_ids)
        if self.fused:
            from .triton_moe import fused_experts
            return fused_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                                 gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                                 swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha,
                                 input_quant=self.input_quant)
        return grouped_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.activation,
                               self.gate_up_proj_bias, self.down_proj_bias, self.input_quant)

    # -- loading: full checkpoint tensors in, this rank's slices stored --------------------------------------
    def defer_stacks(self) -> dict[str, nn.Parameter]:
        """Takes the float stacks out before the model is allocated (the loader, when the experts will be kept
        quantized: their float memory is never taken, nor counted in a GPU's load peak); `restore_deferred` puts
        them back as shapes on the meta device, allocated by the first load that writes them."""
        return {name: self._parameters.pop(name) for name in ("gate_up_proj", "down_proj")}

    def restore_deferred(self, stacks: dict[str, nn.Parameter], device: torch.device, dtype: torch.dtype) -> None:
        self.stack_device = device
        for name, p in stacks.items():
            self.register_parameter(name, nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta"),
                                                       requires_grad=False))

    def _materialize(self) -> None:
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(self, name)
            if p.device.type == "meta":
                setattr(self, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.stack_device),
                                                 requires_grad=False))

    def _rows(self) -> slice:
        return slice(self.tp_rank * self.intermediate_size, (self.tp_rank + 1) * self.intermediate_size)

    @torch.no_grad()
    def load_gate_or_up(self, which: str, expert: int | None, tensor: torch.Tensor, bias: bool = False) -> None:
        """which: "gate" or "up"; tensor [I, H] (or [I] for a bias); [E, ...] for every expert when expert is None."""
        self._materialize()
        half = {"gate": 0, "up": 1}[which]
        target = self.gate_up_proj_bias if bias else self.gate_up_proj
        target = target if expert is None else target[expert]
        dim = 1 if expert is None else 0
        inter = self.intermediate_size
        _check_full(tensor, dim, inter * self.tp_size, which)
        if not bias and self.weight_transform is not None:
            tensor = self.weight_transform(tensor, which)
        _copy(target.narrow(dim, half * inter, inter), tensor.narrow(dim, self._rows().start, inter), which)

    @torch.no_grad()
    def load_gate_up(self, expert: int | None, tensor: torch.Tensor, bias: bool = False) -> None:
        """tensor [2I, H]: gate rows then up rows (or [E, 2I, H] / biases [2I], [E, 2I])."""
        dim = 1 if expert is None else 0
        full = tensor.shape[dim] // 2
        for which, half in (("gate", 0), ("up", 1)):
            self.load_gate_or_up(which, expert, tensor.narrow(dim, half * full, full), bias)

    @torch.no_grad()
    def load_down(self, expert: int | None, tensor: torch.Tensor, bias: bool = False) -> None:
        """tensor [H, I] (or [E, H, I]); a bias [H] ([E, H]) is held whole by rank 0, zero elsewhere."""
        self._materialize()
        if bias:
            target = self.down_proj_bias if expert is None else self.down_proj_bias[expert]
            _copy(target, tensor if self.tp_rank == 0 else torch.zeros_like(tensor), "down bias")
            return
        target = self.down_proj if expert is None else self.down_proj[expert]
        rows = self._rows()
        _check_full(tensor, -1, self.intermediate_size * self.tp_size, "down")
        if self.weight_transform is not None:
            tensor = self.weight_transform(tensor, "down")
        _copy(target, tensor.narrow(-1, rows.start, self.intermediate_size), "down")


def _parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _copy(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"expert weight ({what}) has shape {tuple(tensor.shape)}, the config implies "
                         f"{tuple(target.shape)}")
    target.copy_(tensor)


def _check_full(tensor: torch.Tensor, dim: int, size: int, what: str) -> None:
    if tensor.dim() == 0 or tensor.shape[dim] != size:
        raise ValueError(f"expert weight ({what}) has shape {tuple(tensor.shape)}; the config implies an "
                         f"intermediate size of {size}")
