"""The experts of one MoE layer on the CPU (and the reference the fused kernel is checked against): the
(token, choice) pairs sorted by expert, each active expert's tokens gathered into one block and run through
its two matmuls at once, the results weighted and summed back per token. No Python loop over tokens.

Where torch has it, one grouped product per projection (`torch._grouped_mm` over the sorted rows, with the
experts' row offsets) runs every expert at once, as transformers' CPU default does: 3-5x faster than a pair
of products per active expert for a 32-expert layer at batch 1-256 here, and bit-equal to it (measured with
the layer's shapes of benchmarks/bench_moe.py). Otherwise, and for dtypes it refuses, one pair per expert.
float32 steps with a few rows per expert (decode) take the native library's grouped product instead
(native_grouped.py): one call on the native pool per projection, where torch's runs a GEMM per expert.

`input_quant` (W8A8 experts, expert_input_quant.py): the hidden states quantized before the gathered block (once per
token, or per row with its expert's static scale), the activation's rows before the down product."""
from __future__ import annotations

from collections.abc import Callable

import torch

from . import native_grouped


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor],
                    gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                    input_quant=None, products=None) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; topk_weights, topk_ids [T, k]; activation: [n, 2I] -> [n, I].
    Returns [T, H]: sum over each token's k experts of weight * expert(x). `products(which, expert, rows, out, bias)`,
    when given, multiplies one expert's rows by its kept-quantized gate_up or down weight (int_experts.py; the
    float stacks are then shapes only)."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order inside a group
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    groups = [(e, slice(start - n, start)) for e, n, start in zip(range(len(counts)), counts, _ends(counts)) if n]
    tokens = order // top_k
    experts = flat[order] if input_quant is not None else None  # float models: as before, no extra op
    if input_quant is None:
        gathered = x.index_select(0, tokens)
    elif (quantized := input_quant.hidden(x)) is not None:  # every expert reads the token alike
        gathered = quantized.index_select(0, tokens)
    else:
        gathered = input_quant.hidden_rows(x.index_select(0, tokens), experts)
    activation = activation if input_quant is None else _then_quantize(activation, input_quant, experts)
    native = products is None and native_grouped.serves(gathered, gate_up, counts)
    if native or (products is None and _grouped_mm_serves(gathered, gate_up)):  # every expert's rows in one product
        offsets = torch.tensor(_ends(counts), dtype=torch.int32, device=x.device)
        experts = flat[order] if experts is None else experts
        product = native_grouped.grouped_linear if native else _torch_grouped
        h = product(gathered, gate_up, offsets)
        if gate_up_bias is not None:
            h.add_(gate_up_bias.index_select(0, experts))
        out = product(activation(h), down, offsets)
        if down_bias is not None:
            out.add_(down_bias.index_select(0, experts))
    else:  # two products per active expert, each written in place into its rows; the activation once
        product = products or (lambda which, e, rows, out, bias: _product(
            rows, (gate_up if which == "gate_up" else down)[e], out, bias))
        h = gathered.new_empty(gathered.shape[0], gate_up.shape[1])
        for expert, rows in groups:
            product("gate_up", expert, gathered[rows], h[rows], None if gate_up_bias is None else gate_up_bias[expert])
        act = activation(h)
        out = gathered.new_empty(gathered.shape[0], down.shape[1])
        for expert, rows in groups:
            product("down", expert, act[rows], out[rows], None if down_bias is None else down_bias[expert])
    out.mul_(topk_weights.reshape(-1)[order].unsqueeze(1).to(out.dtype))
    # Added back in expert order per token: the order transformers' eager experts add them in.
    return torch.zeros_like(x).index_add_(0, tokens, out)


USE_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _torch_grouped(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, weights.transpose(1, 2), offs=offsets)


def _then_quantize(activation, input_quant, experts: torch.Tensor):
    """The activation, then each (token, expert) row quantized as its expert's down_proj quantizes its input."""
    return lambda h: input_quant.intermediate(activation(h), experts)


def _grouped_mm_serves(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """torch's grouped product on the CPU, in the dtypes it takes there (float32 and bfloat16)."""
    return (USE_GROUPED_MM and x.device.type == "cpu" and x.dtype == weights.dtype
            and x.dtype in (torch.float32, torch.bfloat16))


def _ends(counts: list[int]) -> list[int]:
    ends, total = [], 0
    for n in counts:
        total += n
        ends.append(total)
    return ends


def _product(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out = x @ weight.T (+ bias), in place. torch's own product even in a small CPU step, where the dense
    projections go to OpenBLAS (platforms/cpu/cpu_blas.py): an expert's few rows gain nothing from OpenBLAS's threads,
    and hundreds of its calls a step cost more than torch's one-thread products (measured on this machine)."""
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)
