"""The native CPU kernels (kubeinfer/engine/platforms/cpu/native): the W8A8 product equals torch._int_mm and
activations.int8_linear's scaling bit for bit; the llama.cpp arithmetic (Q8_0 activations) equals a reference
built from the `gguf` package's Q8_0 (llama.cpp's own numpy port: quantize, dequantize, float64 product);
the portable C build (KUBEINFER_CPU_NATIVE_PORTABLE=1) gives the VNNI build's bits; an engine serving a W8A8
checkpoint gives the same greedy tokens through either kernel."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from native_builds import outputs_by_level, outputs_of_both_builds

from kubeinfer.engine.model_executor.layers.quantization import activations
from kubeinfer.engine.model_executor.layers.quantization.activations import ActivationScheme
from kubeinfer.engine.platforms.cpu.native import ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler: the native kernels do not build here")
TOKEN = ActivationScheme("int", "token", True)
SHAPES = [(1, 64, 16), (3, 100, 33), (16, 2048, 80), (33, 96, 70), (1, 7, 5)]  # (M, K, N): K, N not aligned too


def int8_case(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 1, m).unsqueeze(1)
    x[-1, : k // 2] = 0  # a token with zeros, and a saturating value
    x[0, 0] = 1e3
    return x, w, torch.rand(n, generator=g) * 0.01 + 1e-4


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_w8a8_product_equals_int_mm_bit_for_bit(m, k, n):
    x, w, scale = int8_case(m, k, n)
    expected = activations.int8_linear(x, TOKEN, w.t().contiguous(), scale)
    got = ops.w8a8_linear(x, TOKEN, ops.pack_int8(w), scale)
    assert torch.equal(got, expected)
    # through the torch quantization (what a tensor-parallel rank's whole-token range takes), too
    whole = lambda lo, hi: (lo, hi)  # noqa: E731
    assert torch.equal(ops.w8a8_linear(x, TOKEN, ops.pack_int8(w), scale, reduce_range=whole), expected)


def test_w8a8_guard_a_wrong_correction_is_seen():
    """The comparison catches an off-by-one in the +128 correction (a weight changed by one in one row)."""
    x, w, scale = int8_case(3, 64, 16)
    expected = activations.int8_linear(x, TOKEN, w.t().contiguous(), scale)
    w2 = w.clone()
    w2[5, 3] = w2[5, 3] + (1 if w2[5, 3] < 127 else -1)
    assert not torch.equal(ops.w8a8_linear(x, TOKEN, ops.pack_int8(w2), scale), expected)
    assert torch.equal(ops.unpack_int8(ops.pack_int8(w), *w.shape), w)


def test_w8a8_refuses_too_many_inputs():
    with pytest.raises(ValueError, match="at most 65536"):
        ops.w8a8_linear(torch.zeros(1, ops.MAX_INPUTS + 32), TOKEN, torch.zeros(0, dtype=torch.uint8),
                        torch.zeros(1))


def gguf_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's product as gguf's numpy Q8_0 defines its activations: quantized per block of 32, dequantized,
    then a float64 product with the dequantized weight."""
    from gguf import GGMLQuantizationType, quants

    blocks = quants.quantize(x.numpy().astype(np.float32), GGMLQuantizationType.Q8_0)
    x_hat = quants.dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(x.shape).astype(np.float64)
    return torch.from_numpy(x_hat @ weight.double().numpy().T)


def grouped_case(m, k, n, bits, group, asym, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-128, 128) if bits == 8 else (-8, 8)
    w = torch.randint(lo, hi, (n, k), dtype=torch.int8, generator=g)
    groups = -(-k // group)
    scale = torch.rand(n, groups, generator=g) * 0.01 + 1e-3
    zero = torch.randint(lo // 2, hi // 2, (n, groups), dtype=torch.int8, generator=g) if asym else None
    expand = lambda t: t.float().repeat_interleave(group, 1)[:, :k]  # noqa: E731
    dense = (w.float() - (expand(zero) if asym else 0)) * expand(scale)
    offset = (128 if bits == 8 else 8) + (zero.to(torch.int32) if asym else torch.zeros(n, groups, dtype=torch.int32))
    packed = ops.pack_int8(w) if bits == 8 else ops.pack_int4(w)
    args = (packed, bits, ops.pack_groups(scale, torch.float32), ops.pack_groups(offset, torch.int32), group, n)
    return torch.randn(m, k, generator=g), dense, args


CASES = [(1, 64, 16, 8, 64, False), (3, 128, 33, 8, 32, True), (16, 512, 48, 4, 128, False),
         (33, 256, 70, 4, 32, True), (5, 256, 40, 4, 64, True), (2, 96, 16, 8, 96, False)]


@pytest.mark.parametrize("m,k,n,bits,group,asym", CASES)
def test_llama_cpp_arithmetic_equals_gguf_reference(m, k, n, bits, group, asym):
    x, dense, args = grouped_case(m, k, n, bits, group, asym)
    expected = gguf_reference(x, dense)
    got = ops.q8_0_linear(x, *args).double()
    # float32 block sums and accumulation against float64: within float rounding of the output's size
    assert (got - expected).abs().max() <= 2e-6 * expected.abs().max()
    # the guard: the same weights with float (unquantized) activations are measurably farther
    unquantized = x.double() @ dense.double().T
    assert (unquantized - expected).abs().max() > 100 * (got - expected).abs().max()


def test_llama_cpp_arithmetic_refuses_partial_blocks():
    empty = torch.zeros(0)
    with pytest.raises(ValueError, match="blocks of 32; got 40"):
        ops.q8_0_linear(torch.zeros(1, 40), empty, 8, empty, empty, 40, 16)


def test_q8_0_activations_equal_gguf_bit_for_bit():
    from gguf import GGMLQuantizationType, quants

    x = torch.randn(7, 256) * torch.logspace(-4, 2, 7).unsqueeze(1)
    x[2, :32] = 0
    x[3, 5] = 127 * 0.5 / 127  # a value whose x / d lands near a half
    q, d, sums = ops.quantize_q8_0(x)
    blocks = quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0).reshape(7, 8, 34)
    assert np.array_equal(q.numpy(), blocks[:, :, 2:].copy().view(np.int8).reshape(7, 256))
    assert np.array_equal(d.numpy(), blocks[:, :, :2].copy().view(np.float16).astype(np.float32).reshape(7, 8))
    assert torch.equal(sums, q.view(7, 8, 32).sum(-1, dtype=torch.int32))


def test_activation_rounding_of_exact_halves():
    """Values that land exactly on k + 0.5 (the vectorized quantizations' rounding): Q8_0 rounds half away from
    zero (gguf), the W8A8 per-token int8 half to even (torch)."""
    from gguf import GGMLQuantizationType, quants

    halves = torch.arange(-127, 127, dtype=torch.float32) + 0.5  # 254 values in [-126.5, 126.5]
    x = torch.cat([halves, torch.tensor([127.0, -127.0])]).view(8, 32)  # amax 127 per block: d = 1, x * id = x
    x[:, 0] = torch.where(x[:, 0].abs() == 127, x[:, 0], torch.tensor(127.0))
    q, _, _ = ops.quantize_q8_0(x)
    blocks = quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0).reshape(8, 34)
    assert np.array_equal(q.numpy(), blocks[:, 2:].copy().view(np.int8))
    assert q[0, 1] == -126 and q[0, 2] == -125  # -125.5 -> -126, -124.5 -> -125: away from zero
    w = torch.eye(48, 100, dtype=torch.int8)  # the product picks single activations out
    row = torch.cat([torch.tensor([127.5]), torch.arange(-49, 50, dtype=torch.float32) + 0.5])  # scale 1: halves
    got = ops.w8a8_linear(row[None], TOKEN, ops.pack_int8(w), torch.ones(48))
    assert torch.equal(got, activations.int8_linear(row[None], TOKEN, w.t().contiguous(), torch.ones(48)))
    assert got[0, 1] == -48 and got[0, 2] == -48  # -48.5 -> -48, -47.5 -> -48: to even


def test_portable_build_equals_the_vnni_build(monkeypatch):
    """KUBEINFER_CPU_NATIVE_PORTABLE=1 builds the plain C twins; they give the same bits."""
    def products():
        w8a8 = [ops.w8a8_linear(x, TOKEN, ops.pack_int8(w), scale)
                for x, w, scale in (int8_case(m, k, n) for m, k, n in SHAPES[:4])]
        q8 = [ops.q8_0_linear(x, *args) for x, _, args in (grouped_case(*case) for case in CASES)]
        return w8a8 + q8

    native, portable = outputs_of_both_builds(monkeypatch, products)
    assert all(torch.equal(a, b) for a, b in zip(native, portable))


def test_every_level_gives_the_portable_bits(monkeypatch):
    """The v4 (vpdpbusd), v3 (AVX2: vpmaddwd on int16) and portable builds, each forced: the W8A8 and Q8_0
    products' bits, every shape (1 to 33 tokens: the AVX2 pairs of tokens and an odd one; N past 16 and not
    aligned: the masked halves), weights at both ends of int8 (-128 and 127: exact int32 sums)."""
    def products():
        cases = [int8_case(m, k, n, seed=4) for m, k, n in SHAPES]
        ends = torch.tensor([-128, 127], dtype=torch.int8).repeat(40, 50)  # [40, 100]
        cases.append((torch.full((5, 100), -7.0), ends, torch.ones(40)))
        w8a8 = [ops.w8a8_linear(x, TOKEN, ops.pack_int8(w), scale) for x, w, scale in cases]
        return w8a8 + [ops.q8_0_linear(x, *args) for x, _, args in (grouped_case(*case) for case in CASES)]

    outs = outputs_by_level(monkeypatch, products)
    assert "portable" in outs and len(outs) >= 2, f"only {list(outs)} run here"
    for level, got in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(got, outs["portable"])), level


def test_w8a8_engine_tokens_equal_int_mm(tmp_path, monkeypatch):
    """A compressed-tensors W8A8 checkpoint (int8 weights per channel, int8 dynamic activations per token):
    the same greedy tokens through the native kernel as through torch._int_mm (the same bits, so no ties)."""
    from quant_checkpoints import SHAPE, engine_greedy
    from test_quantized_w8a8 import w8a8_checkpoint

    from kubeinfer.dev.testing.random_model import build_random_model

    float_dir = build_random_model(tmp_path / "float", "llama", tokenizer=False, seed=3, **SHAPE)
    model_dir = w8a8_checkpoint(float_dir, "int8_dynamic")
    tokens = {}
    for kernel in ("int8_vnni", "int_mm"):
        monkeypatch.setenv("KUBEINFER_W8A8_KERNEL", kernel)
        tokens[kernel] = engine_greedy(model_dir)
    assert tokens["int8_vnni"] == tokens["int_mm"]
