"""The Triton dequantize-and-multiply kernel (layers/quantization/triton_int_matmul.py) against torch's matmul
on the dequantized weight, (q - zero) * scale, run in Triton's CPU interpreter when there is no GPU (as
tests/engine/test_triton_kernels.py does, TRITON_INTERPRET=1 is set before triton is imported)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_triton_kernels import DEVICES, tolerance

from kubeinfer.engine.model_executor.layers.quantization.linear_method import IntWeight


def random_int_weight(out: int, cols: int, bits: int, group: int, symmetric: bool, seed: int) -> IntWeight:
    gen = torch.Generator().manual_seed(seed)
    low, high = -(1 << (bits - 1)), 1 << (bits - 1)
    groups = cols // group
    values = torch.randint(low, high, (out, cols), generator=gen).to(torch.int8)
    scale = torch.rand(out, groups, generator=gen) * 0.05 + 0.01
    zero = None if symmetric else torch.randint(low, high, (out, groups), generator=gen).to(torch.int8)
    return IntWeight(values, scale, zero, group, bits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits, group, symmetric", [(4, 32, False), (4, 128, True), (8, 128, True),
                                                    (8, 256, False), (4, 256, False)],
                         ids=["int4-g32-asym", "int4-g128-sym", "int8-channel-sym", "int8-channel-asym",
                              "int4-channel-asym"])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_int_matmul_matches_torch_on_the_dequantized_weight(device, dtype, bits, group, symmetric, tokens):
    from kubeinfer.engine.model_executor.layers.quantization.linear_method import WeightOnlyIntMethod

    out, cols = 80, 256  # 80 output rows: a partial 64-row tile
    weight = random_int_weight(out, cols, bits, group, symmetric, seed=bits * group + tokens)
    layer = torch.nn.Linear(cols, out, bias=True, device=device, dtype=dtype)
    method = WeightOnlyIntMethod(layer, weight, "triton", dtype)
    if bits == 4:
        assert layer.qweight.dtype == torch.uint8 and tuple(layer.qweight.shape) == (out, cols // 2)
    else:
        assert layer.qweight.dtype == torch.int8 and tuple(layer.qweight.shape) == (out, cols)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    got = method.apply(layer, x)
    want = x.double().cpu() @ weight.dequantize().double().t() + layer.bias.double().cpu()
    assert got.dtype == dtype
    torch.testing.assert_close(got.double().cpu(), want, **tolerance(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits, symmetric", [(4, False), (8, True)])
def test_tensor_parallel_slices_multiply_like_the_whole_weight(device, bits, symmetric):
    """A rank's slice in the kernel's layout (model_executor/int_weights.py): output rows of a column-parallel
    layer give those outputs; input columns of a row-parallel one, cut on group boundaries or inside groups
    (regrouped, IntWeight.narrow), give partial sums that add up to the whole product."""
    from kubeinfer.engine.model_executor.layers.quantization.linear_method import WeightOnlyIntMethod

    out, cols = 48, 256
    weight = random_int_weight(out, cols, bits, 64, symmetric, seed=7)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(2)).to(device)
    whole = x.double().cpu() @ weight.dequantize().double().t()

    def product(piece, inputs):
        layer = torch.nn.Linear(piece.values.shape[1], piece.values.shape[0], bias=False, device=device)
        return WeightOnlyIntMethod(layer, piece, "triton", torch.float32).apply(layer, inputs).double().cpu()

    rows = product(weight.narrow(0, 16, 32), x)
    torch.testing.assert_close(rows, whole[:, 16:48], **tolerance(torch.float32))
    for cut in (128, 96):  # on a group boundary; inside a group (groups of 32 on both sides)
        left, right = weight.narrow(1, 0, cut), weight.narrow(1, cut, cols - cut)
        assert (left.group_size, right.group_size) == ((64, 64) if cut == 128 else (32, 32))
        total = product(left, x[:, :cut]) + product(right, x[:, cut:])
        torch.testing.assert_close(total, whole, **tolerance(torch.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group, symmetric", [(256, True), (128, False)], ids=["channel-sym", "g128-asym"])
def test_half_precision_dot_multiplies_the_exact_integers(device, group, symmetric, monkeypatch):
    """The tensor-core path (half-precision activations), in the interpreter too: fp16, which it computes
    exactly (bf16 it does not: docs of ENVIRONMENT.md). int8 weights scaled ~0.03 reach ~8; a dot on the
    scaled weight rounded to the activations' dtype missed outputs near 0 by ~1e-2 in fp16 (by 0.2-0.4 in bf16
    on the first GPU run). The kernel multiplies q - zero, exact, and scales the fp32 sums: each output is the
    exact sum up to its rounding to fp16."""
    from kubeinfer.engine.model_executor.layers.quantization import triton_int_matmul

    monkeypatch.setattr(triton_int_matmul, "must_upcast", lambda t: t.dtype == torch.float32)  # the GPU's rule
    weight = random_int_weight(80, 256, 8, group, symmetric, seed=5)
    x = torch.randn(33, 256, generator=torch.Generator().manual_seed(3)).half()
    zero = None if weight.zero is None else weight.zero.to(device)
    got = triton_int_matmul.int_matmul(x.to(device), weight.values.to(device), weight.scale.to(device), zero, group,
                                       int4=False)
    want = x.double() @ weight.dequantize().double().t()
    assert got.dtype == torch.float16 and want.abs().max() > 30
    torch.testing.assert_close(got.double().cpu(), want, atol=2e-3, rtol=1e-3)
