"""The fused MoE Triton kernel reading kept-quantized experts (layers/fused_moe/int_experts.py, triton_moe.py),
under Triton's interpreter without a GPU: int8 per channel, int4 by groups with zero points (two a byte) and
fp8 e4m3 with block-wise scales (spread to a row and group each), each against the CPU grouped path on the
same weights dequantized in torch (IntWeight.dequantize's definition: (q - zero) * scale). Small shapes: the
interpreter is slow."""
from __future__ import annotations

import pytest
import torch
from test_fused_moe import uneven_routing
from test_triton_kernels import DEVICES  # also sets TRITON_INTERPRET=1 without CUDA, before triton loads

from kubeinfer.engine.model_executor.layers.fused_moe.activation import silu_and_mul
from kubeinfer.engine.model_executor.layers.fused_moe.grouped import grouped_experts
from kubeinfer.engine.model_executor.layers.fused_moe.int_experts import ExpertsIntMethod, stack
from kubeinfer.engine.model_executor.layers.fused_moe.layer import FusedMoE
from kubeinfer.engine.model_executor.layers.quantization.linear_method import IntWeight

E, H, I = 8, 64, 32  # noqa: E741 (the experts' intermediate size, as in test_fused_moe.py)


def int_weight(kind: str, rows: int, cols: int, g: torch.Generator) -> IntWeight:
    if kind == "int8":
        values = torch.randint(-127, 128, (rows, cols), generator=g, dtype=torch.int8)
        return IntWeight(values, torch.rand(rows, 1, generator=g) / 64 + 1e-3, None, cols, 8)
    if kind == "int4":
        group = 16
        values = torch.randint(-8, 8, (rows, cols), generator=g, dtype=torch.int8)
        zero = torch.randint(-8, 8, (rows, cols // group), generator=g, dtype=torch.int8)
        return IntWeight(values, torch.rand(rows, cols // group, generator=g) / 8 + 1e-3, zero, group, 4)
    # fp8, blocks of [16 rows, 16 columns]: one scale per block, spread to every row of it
    values = (torch.randn(rows, cols, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = torch.rand(rows // 16, cols // 16, generator=g) / 400 + 1e-4
    return IntWeight(values, blocks.repeat_interleave(16, 0), None, 16, 8, fp8=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_fused_kernel_dequantizes_kept_experts_like_torch(device, kind, num_tokens):
    g = torch.Generator().manual_seed(7)
    gate_up = stack([int_weight(kind, 2 * I, H, g) for _ in range(E)])
    down = stack([int_weight(kind, H, I, g) for _ in range(E)])
    x = torch.randn(num_tokens, H, generator=g)
    weights, ids = uneven_routing(num_tokens, seed=num_tokens)
    expected = grouped_experts(x, gate_up.dequantize(), down.dequantize(), weights, ids, silu_and_mul)

    moe = FusedMoE(E, H, I).to(device)  # as the loader holds it, then the kept weights replace the float stacks
    moe.int_method = ExpertsIntMethod(moe, {"gate_up": gate_up, "down": down}, "triton", torch.float32)
    assert moe.gate_up_proj.device.type == "meta" and moe.gate_up_qweight.dtype in (torch.int8, torch.uint8)
    if kind == "int4":  # two weights a byte
        assert moe.gate_up_qweight.shape == (E, 2 * I, H // 2) and moe.gate_up_zero.dtype == torch.int8
    got = moe(x.to(device), weights.to(device), ids.to(device)).cpu()
    assert expected.abs().max() > 0.1  # not a vacuous comparison
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_kernel_on_kept_int8_experts_quantizes_their_inputs(device, monkeypatch):
    """W8A8 experts on the GPU path: the inputs quantized per token as before (expert_input_quant.py), the kept int8
    weights dequantized in the kernel: the grouped path's result on the dequantized weights, same input_quant.

    Checked in two halves, each against the definition: the fp32 intermediate (silu(gate) * up) that the
    definition quantizes has last bits that depend on the order its sums are added in (the interpreter's numpy,
    the GPU's FMA chain, a dot on the integers then scaled), and one element on the other side of a rounding
    step moves its token's outputs by up to ~1.5 here (one int8 step of a row scaled ~1, times a down weight):
    so the first GEMM is compared before the rounding, and the rest of the definition is run on the kernel's own
    intermediate."""
    from kubeinfer.engine.model_executor.layers.quantization.expert_input_quant import ExpertInputQuant
    from kubeinfer.engine.model_executor.layers.quantization.activations import ActivationScheme

    g = torch.Generator().manual_seed(3)
    gate_up = stack([int_weight("int8", 2 * I, H, g) for _ in range(E)])
    down = stack([int_weight("int8", H, I, g) for _ in range(E)])
    token = ActivationScheme("int", "token", dynamic=True)
    quant = ExpertInputQuant(token, token, {})
    x = torch.randn(6, H, generator=g)
    weights, ids = uneven_routing(6, seed=2)
    gate_up_f, down_f = gate_up.dequantize(), down.dequantize()
    moe = FusedMoE(E, H, I).to(device)
    moe.input_quant = quant.to(device)
    moe.int_method = ExpertsIntMethod(moe, {"gate_up": gate_up, "down": down}, "triton", torch.float32)
    kernel_rows = []  # what the fused path quantizes before the down GEMM: [pairs, I], pairs in token order
    quantize_rows = quant.intermediate
    monkeypatch.setattr(quant, "intermediate", lambda rows, experts: kernel_rows.append(rows.cpu())
                        or quantize_rows(rows, experts))
    got = moe(x.to(device), weights.to(device), ids.to(device)).cpu()
    monkeypatch.undo()
    sorted_rows = kernel_rows[0][torch.argsort(ids.reshape(-1), stable=True)]  # the grouped path's row order
    h_of = {}

    def kernel_activation(h, key):  # records the definition's h; gives the kernel's intermediate
        h_of[key] = h
        return sorted_rows

    expected = grouped_experts(x, gate_up_f, down_f, weights, ids, lambda h: kernel_activation(h, "quantized"),
                               input_quant=quant)
    grouped_experts(x, gate_up_f, down_f, weights, ids, lambda h: kernel_activation(h, "float"))
    # the first GEMM read the quantized hidden states (the float ones give another intermediate)
    torch.testing.assert_close(sorted_rows, silu_and_mul(h_of["quantized"]), rtol=1e-4, atol=1e-3)
    assert not torch.allclose(sorted_rows, silu_and_mul(h_of["float"]), rtol=1e-4, atol=1e-3)
    # the intermediate quantized as the definition quantizes it, then the down GEMM, weights and sum
    unquantized = grouped_experts(x, gate_up_f, down_f, weights, ids, lambda h: sorted_rows)
    assert not torch.allclose(expected, unquantized, rtol=1e-4, atol=1e-4)  # the input quantization shows
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
