"""fp8 (e4m3) weights kept in memory as their bits and multiplied through the Triton dequantize-and-multiply
kernel (layers/quantization/triton_int_matmul.py), against torch: the decoder against torch's own float8_e4m3fn
over all 256 bit patterns, the product against F.linear on the weight torch dequantizes (fp8.dequantize), for
per-tensor, per-channel and block-wise scales with partial last blocks. Run in Triton's CPU interpreter when
there is no GPU (TRITON_INTERPRET=1 set before triton is imported, as tests/engine/test_triton_int_matmul.py)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_triton_kernels import DEVICES, INTERPRETER, tolerance

from kubeinfer.engine.model_executor.layers.quantization import fp8
from kubeinfer.engine.model_executor.layers.quantization.linear_method import WeightOnlyIntMethod


@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_decoder_matches_torch_on_every_bit_pattern(device):
    from kubeinfer.engine.model_executor.layers.quantization.triton_int_matmul import decode_e4m3

    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = bits.view(torch.float8_e4m3fn).float()
    got = decode_e4m3(bits.to(device)).cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and int(torch.isnan(want).sum()) == 2  # 0x7F, 0xFF
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite], want[finite])  # exact, the signs of the zeros included
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))


def test_e4m3_decoder_keeps_the_sign_where_negation_is_a_subtraction(monkeypatch):
    """Triton before 3.7 lowers a float negation `-x` to `0.0 - x` (its interpreter and the GPU alike), which
    turns -0.0 (0x80) into +0.0: the GPU machines' Triton 3.6 failed the test above so. This interpreter's
    negation made to subtract as those do; the decoder sets the sign bit with integer ops and keeps it."""
    import numpy as np

    interpreter = pytest.importorskip("triton.runtime.interpreter")
    builder = interpreter.InterpreterBuilder
    if not INTERPRETER or not hasattr(builder, "create_fneg"):
        pytest.skip("needs Triton's interpreter with its own float negation (3.7 on)")
    monkeypatch.setattr(builder, "create_fneg", lambda self, x: self.unary_op(x, lambda a: np.zeros_like(a) - a))
    from kubeinfer.engine.model_executor.layers.quantization.triton_int_matmul import decode_e4m3

    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got, want = decode_e4m3(bits), bits.view(torch.float8_e4m3fn).float()
    finite = ~torch.isnan(want)
    assert torch.equal(torch.isnan(got), ~finite)
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))  # every bit: -0.0 is 0x80000000


def fp8_checkpoint_weight(out: int, cols: int, layout: str, seed: int):
    """(e4m3 weight, scale, config) as a checkpoint stores them: per tensor, per channel, or in [32, 64] blocks
    (the last ones partial when out, cols are not multiples)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=gen) * 0.05
    if layout == "block":
        bn, bk = 32, 64
        config = fp8.Fp8Config((bn, bk))
        scale = torch.rand(-(-out // bn), -(-cols // bk), generator=gen) * 0.01 + 1e-3
        expanded = scale.repeat_interleave(bn, 0)[:out].repeat_interleave(bk, 1)[:, :cols]
    else:
        config = fp8.Fp8Config(None)
        scale = torch.rand(out, 1, generator=gen) * 0.01 + 1e-3 if layout == "channel" else torch.tensor(3e-4)
        expanded = scale
    values = (w / expanded).clamp(-448, 448).to(torch.float8_e4m3fn)
    return values, scale, config


def kept(values, scale, config, key="layer.weight"):
    weight = config.int_weight(key, values, lambda k: scale if k.endswith("weight_scale_inv") else None)
    assert weight is not None and weight.fp8
    return weight


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout, out, cols", [("tensor", 48, 64), ("channel", 80, 96), ("block", 80, 160)])
@pytest.mark.parametrize("tokens, bias", [(1, True), (5, False)])
def test_fp8_matmul_matches_torch_on_the_dequantized_weight(device, dtype, layout, out, cols, tokens, bias):
    values, scale, config = fp8_checkpoint_weight(out, cols, layout, seed=out + cols + tokens)
    weight = kept(values, scale, config)
    layer = torch.nn.Linear(cols, out, bias=bias, device=device, dtype=dtype)
    method = WeightOnlyIntMethod(layer, weight, "triton", dtype)
    assert layer.qweight.dtype == torch.uint8 and tuple(layer.qweight.shape) == (out, cols)  # one byte a weight
    assert layer.weight.device.type == "meta"
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    got = method.apply(layer, x)
    dense = fp8.dequantize(values, scale, config, "layer.weight").double()
    want = F.linear(x.double().cpu(), dense, None if layer.bias is None else layer.bias.double().cpu())
    assert got.dtype == dtype
    torch.testing.assert_close(got.double().cpu(), want, **tolerance(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_parallel_slices_of_block_scaled_weights(device):
    """A rank's rows (column-parallel) or columns (row-parallel), cut on block boundaries or inside a block
    (regrouped exactly, IntWeight.narrow), multiply like those parts of the whole weight."""
    out, cols = 96, 192
    values, scale, config = fp8_checkpoint_weight(out, cols, "block", seed=3)
    weight = kept(values, scale, config)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(2))
    whole = x.double() @ fp8.dequantize(values, scale, config, "w").double().t()

    def product(piece, inputs):
        layer = torch.nn.Linear(piece.values.shape[1], piece.values.shape[0], bias=False, device=device)
        return WeightOnlyIntMethod(layer, piece, "triton", torch.float32).apply(layer, inputs.to(device)).double().cpu()

    torch.testing.assert_close(product(weight.narrow(0, 16, 48), x), whole[:, 16:64], **tolerance(torch.float32))
    for cut in (128, 96):  # on a block boundary; inside a block (groups of 32)
        left, right = weight.narrow(1, 0, cut), weight.narrow(1, cut, cols - cut)
        assert left.fp8 and left.group_size == (64 if cut == 128 else 32)
        total = product(left, x[:, :cut]) + product(right, x[:, cut:])
        torch.testing.assert_close(total, whole, **tolerance(torch.float32))


def test_kept_weight_dequantizes_like_the_checkpoint_reader():
    """The CPU's path (and a fused weight with a dequantized part): IntWeight.dequantize of the kept form is
    fp8.read's float32 weight exactly, for fused parts (cat) too."""
    for layout in ("tensor", "channel", "block"):
        values, scale, config = fp8_checkpoint_weight(80, 160, layout, seed=5)
        weight = kept(values, scale, config)
        assert torch.equal(weight.dequantize(), fp8.dequantize(values, scale, config, "w"))
        both = type(weight).cat([weight, weight])
        assert torch.equal(both.dequantize(), torch.cat([weight.dequantize()] * 2))
