"""The W4A8 product (platforms/cpu/native/w4a8_linear.c, w4a8_ops.py): int8 activations per token times
int4 weights per group, out = sum over groups of fl(isum_g * fl(x_scale * w_scale_g)).

- Its int8 activations and scales are the compressed-tensors package's own (compute_dynamic_scales_and_zp,
  quantize to int8), bit for bit, through the C quantization and through activations.py's.
- Against a float64 computation of the formula from the same int8 activations and int4 weights: within
  (groups + 2) * 2^-24 of the sum of the terms' magnitudes (each term rounded twice, the sum once a group;
  measured at most 1.3e-7 relative to it, below the bound of 1.1e-6 at 16 groups), and not within it when one
  weight is off by one (the guard).
- torch._int_mm's twin (w4a8_ops.int_mm_product), the portable C build and the VNNI build give the same bits;
  a token's output is the same bits alone and in any batch (tiles of 1 to 8 tokens, both loops)."""
from __future__ import annotations

import pytest
import torch
from native_builds import outputs_by_level, outputs_of_both_builds

from kubeinfer.engine.model_executor.layers.quantization.activations import ActivationScheme
from kubeinfer.engine.platforms.cpu.native import ops, w4a8_ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler: the native kernels do not build here")
TOKEN = ActivationScheme("int", "token", True)
# (M, K, N, group): None is one group (per channel); K and N not aligned too, partial last groups
SHAPES = [(1, 64, 16, 32), (3, 100, 33, None), (16, 2048, 80, 128), (9, 96, 70, 32), (1, 7, 5, None),
          (20, 256, 48, 64), (5, 160, 17, 128)]


def int4_case(m: int, k: int, n: int, group: int | None, seed: int = 0):
    """x [M, K] (tokens of very different ranges, one all zero, one saturating value), int4 [N, K], scales
    [N, groups], the group size as the kernel takes it."""
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group is None else -(-k // group)
    w = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, groups, generator=g) * 0.01 + 1e-4
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 1, m).unsqueeze(1)
    if m > 2:
        x[1] = 0
    x[0, 0] = 1e3
    return x, w, scale, k if group is None else group


def native(x, w, scale, group, reduce_range=None):
    """The layer's call (w4a8_ops.linear: float32 rows quantized and multiplied in one native call)."""
    packed, packed_scale = w4a8_ops.pack(w, scale)
    return w4a8_ops.linear(x, TOKEN, packed, packed_scale, group, w.shape[0], reduce_range)


def float64_formula(x, w, scale, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(the formula in float64 from the int8 activations of activations.py and the int4 weights, the sum of its
    terms' magnitudes)."""
    from kubeinfer.engine.model_executor.layers.quantization import activations

    sx, _ = activations.dynamic_qparams(x, TOKEN)
    q = activations.quantize(x, sx, None, TOKEN, dequantize=False).double()
    terms = []
    for g in range(scale.shape[1]):
        cols = slice(g * group, min(x.shape[1], (g + 1) * group))
        terms.append((q[:, cols] @ w[:, cols].double().t()) * (sx.double() * scale[:, g].double()))
    return sum(terms), sum(t.abs() for t in terms)


@pytest.mark.parametrize("m,k,n,group", SHAPES)
def test_product_equals_the_float64_formula_within_its_rounding(m, k, n, group):
    x, w, scale, group = int4_case(m, k, n, group)
    expected, magnitude = float64_formula(x, w, scale, group)
    bound = (scale.shape[1] + 2) * 2.0 ** -24
    got = native(x, w, scale, group).double()
    assert ((got - expected).abs() <= bound * magnitude).all()
    w2 = w.clone()  # the guard: one weight off by one in row 3 (at the saturating input) is seen
    w2[3, 0] += 1 if w2[3, 0] < 7 else -1
    off = native(x, w2, scale, group).double()
    assert not ((off - expected).abs() <= bound * magnitude).all()


@pytest.mark.parametrize("m,k,n,group", SHAPES)
def test_int_mm_twin_and_a_rank_s_torch_quantization_give_the_same_bits(m, k, n, group):
    x, w, scale, group = int4_case(m, k, n, group)
    got = native(x, w, scale, group)
    q, sx = w4a8_ops.quantized_tokens(x, TOKEN)
    assert torch.equal(w4a8_ops.int_mm_product(q, sx, w.t().contiguous(), scale.t().contiguous(), group), got)
    assert torch.equal(w4a8_ops.product(q, sx, *w4a8_ops.pack(w, scale), group, n), got)  # pre-quantized input
    whole = lambda lo, hi: (lo, hi)  # noqa: E731  (a tensor-parallel rank's path: activations.py's quantization)
    assert torch.equal(native(x, w, scale, group, reduce_range=whole), got)


def test_activations_are_the_compressed_tensors_packages_bit_for_bit():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    x, *_ = int4_case(24, 200, 16, 32, seed=4)
    x[5, :7] = torch.tensor([127.5, -127.5, 0.5, -0.5, 1.5, 2.5, -2.5]) * (x[5].abs().max() / 127.5)  # halves
    scale, zero = compute_dynamic_scales_and_zp(value=x.unsqueeze(0), args=args, module=None)
    expected = quantize(x.unsqueeze(0), scale, zero, args, dtype=torch.int8)[0]
    for reduce_range in (None, lambda lo, hi: (lo, hi)):  # C, then activations.py
        q, sx = w4a8_ops.quantized_tokens(x, TOKEN, reduce_range)
        assert torch.equal(q, expected.to(torch.int8)) and torch.equal(sx, scale[0].reshape(-1))


def test_a_token_s_output_does_not_depend_on_its_batch():
    x, w, scale, group = int4_case(20, 256, 48, 64, seed=2)
    alone = torch.cat([native(x[i:i + 1], w, scale, group) for i in range(len(x))])
    for size in (1, 3, 5, 8, 9, 16, 20):  # tiles of 1..8 tokens: the memory-bound and the compute-bound loops
        assert torch.equal(native(x[:size], w, scale, group), alone[:size])


def test_portable_build_equals_the_vnni_build(monkeypatch):
    vnni, portable = outputs_of_both_builds(monkeypatch, lambda: [native(*int4_case(*shape)) for shape in SHAPES])
    assert all(torch.equal(a, b) for a, b in zip(vnni, portable))


def test_every_level_gives_the_portable_bits(monkeypatch):
    """The v4 (vpdpbusd), v3 (AVX2: vpmaddubsw then vpmaddwd) and portable builds, each forced: the same bits, at
    1 to 20 tokens (the AVX2 tiles of up to 4 and a remainder)."""
    def products():
        x, w, scale, group = int4_case(20, 256, 48, 64, seed=5)
        return [native(*int4_case(*shape)) for shape in SHAPES] + [native(x[:n], w, scale, group) for n in (1, 6, 20)]

    outs = outputs_by_level(monkeypatch, products)
    assert "portable" in outs and len(outs) >= 2, f"only {list(outs)} run here"
    for level, got in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(got, outs["portable"])), level


def test_layouts_the_kernel_does_not_take():
    assert w4a8_ops.takes(256, 2, 128) and w4a8_ops.takes(100, 1, 100) and w4a8_ops.takes(160, 2, 128)
    assert not w4a8_ops.takes(256, 16, 16)  # groups of 16: not whole blocks of 32
    assert not w4a8_ops.takes(256, 3, 128)  # the scales do not fit the groups
    assert not w4a8_ops.takes(ops.MAX_INPUTS + 32, 1, ops.MAX_INPUTS + 32)
    x, w, scale, _ = int4_case(2, 64, 16, 32)
    with pytest.raises(ValueError, match="not its layout"):
        w4a8_ops.linear(x, TOKEN, *w4a8_ops.pack(w, scale), 16, 16)
