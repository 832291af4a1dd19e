"""The exact A16 product of weight-only int4 / int8 weights (platforms/cpu/native/a16_linear.c, a16_method.py):
against a
float64 product of the format's definition, sum over groups of scale * sum((q - zero) * bf16(x)) with the
activations rounded to bf16 by torch, within a float32 summation bound; the portable C twin gives the AVX-512
build's bits; a token's output is the same bits in any batch and on any number of threads."""
from __future__ import annotations

import pytest
import torch
from native_builds import outputs_by_level, outputs_of_both_builds

from kubeinfer.engine.platforms.cpu.native import a16_method, ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler: the native kernels do not build here")
K, N = 256, 70  # N not a multiple of 16: a padded row group
# (bits, group size or None for one scale per row, asymmetric)
LAYOUTS = [(4, 32, False), (4, 32, True), (4, 64, True), (4, 128, False), (4, None, False), (4, None, True),
           (8, None, False), (8, None, True), (8, 64, True)]


def case(m: int, bits: int, group: int | None, asym: bool, seed: int = 0, k: int = K, n: int = N):
    """(x, the packed kernel arguments, the float64 reference, the float64 sum of |terms| for the bound, and the
    dequantized weight in float64)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-128, 128) if bits == 8 else (-8, 8)
    group = group or k
    w = torch.randint(lo, hi, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    zero = (torch.randint(lo, hi, scale.shape, dtype=torch.int8, generator=g) if asym
            else torch.zeros(scale.shape, dtype=torch.int8))
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m).unsqueeze(1)
    spread = lambda t: t.double().repeat_interleave(group, 1)  # noqa: E731
    dense = (w.double() - spread(zero)) * spread(scale)
    xb = x.to(torch.bfloat16).double()  # torch's rounding of the activations: the only one in the definition
    args = (a16_method.pack(w, bits), bits, ops.pack_groups(scale, torch.float32),
            a16_method.pack_zero(zero, bits), group, n)
    return x, args, xb @ dense.T, xb.abs() @ dense.abs().T, dense


def product(x, args):
    return a16_method.a16_linear(x, *args)


@pytest.mark.parametrize("m", [1, 3, 16, 33])
@pytest.mark.parametrize("bits,group,asym", LAYOUTS)
def test_product_equals_the_float64_definition_within_float32_sums(m, bits, group, asym):
    x, args, expected, magnitude, _ = case(m, bits, group, asym)
    got = product(x, args).double()
    # float32 sums of at most K terms (chains of K / 4, then 2 adds, the scale, one add per group): each rounding
    # at most 2^-24 of the running magnitude. Activations not rounded to bf16 would be ~2^-9 off.
    bound = (K / 4 + 4 + K // (group or K)) * 2.0 ** -24 * magnitude
    assert ((got - expected).abs() <= bound).all(), ((got - expected).abs() / magnitude).max()


def test_the_comparison_sees_a_missing_zero_point_or_unrounded_activations():
    x, args, expected, magnitude, dense = case(3, 4, 32, True)
    bound = (K / 4 + 4 + K // 32) * 2.0 ** -24 * magnitude
    no_zero = (*args[:3], torch.zeros_like(args[3]), *args[4:])
    assert not ((product(x, no_zero).double() - expected).abs() <= bound).all()
    assert not ((x.double() @ dense.T - expected).abs() <= bound).all()  # float32 activations, not bf16
    xr = x.to(torch.bfloat16).float()  # bf16-exact input: the kernel's rounding changes nothing
    assert torch.equal(product(xr, args), product(x, args))


@pytest.mark.parametrize("bits,group,asym", [(4, 32, True), (4, None, False), (8, None, True)])
def test_a_token_gets_the_same_bits_in_any_batch_and_thread_count(bits, group, asym):
    x, args, *_ = case(33, bits, group, asym, seed=3)
    batch = product(x, args)
    alone = torch.cat([product(x[i:i + 1], args) for i in range(33)])
    assert torch.equal(batch, alone)
    assert torch.equal(product(x[:16], args), batch[:16])
    threads = ops.set_threads(1)
    try:
        assert torch.equal(product(x, args), batch)
    finally:
        ops.set_threads(ops.default_threads())
    assert threads == 1


def test_portable_build_equals_the_avx512_build(monkeypatch):
    cases = [case(m, *layout, seed=m) for m in (1, 5) for layout in LAYOUTS]
    # inputs not a multiple of 16 (the AVX-512 rounding of x ends in its scalar tail) or past its 1024-input chunks,
    # and tiles of 8 tokens with a remainder (int8 from 5 tokens)
    cases += [case(m, bits, None, True, seed=9, k=k) for m, k in ((5, 40), (21, 1048)) for bits in (4, 8)]
    # activations near float32's smallest normals: sums that reach subnormals, which vdpbf16ps flushes to zero
    cases += [(x * 2.0 ** e, args) for e in (-124, -127) for x, args, *_ in cases[:4]]
    # each pair's two products cancel into a subnormal: flushed to zero by the instruction, so by the twin
    w = torch.tensor([-1, 1] * 16, dtype=torch.int8).repeat(16, 1)
    x = torch.tensor([2.0 ** -126, 1.0078125 * 2.0 ** -126] * 16).unsqueeze(0)
    ones = torch.ones(16, 1)
    cases.append((x, (a16_method.pack(w, 8), 8, ops.pack_groups(ones, torch.float32),
                      a16_method.pack_zero(torch.zeros(16, 1, dtype=torch.int8), 8), 32, 16)))
    native, portable = outputs_of_both_builds(monkeypatch, lambda: [product(x, args) for x, args, *_ in cases])
    assert all(torch.equal(a, b) for a, b in zip(native, portable))


def level_cases() -> list:
    """Every tiling of both widths (1-8 tokens a tile, a remainder), inputs not a multiple of 8 floats' vectors, and
    activations outside the AVX2 path's exact range (subnormal sums, products past float32's largest, inf, NaN)."""
    cases = [case(m, *layout, seed=m) for m in (1, 4, 13) for layout in LAYOUTS]
    cases += [case(m, *LAYOUTS[(3 * i) % len(LAYOUTS)], seed=m) for i, m in enumerate((2, 3, 5, 6, 7, 8))]
    cases += [case(m, bits, None, True, seed=9, k=k) for m, k in ((5, 40), (9, 1048)) for bits in (4, 8)]
    return cases


def extreme(cases: list) -> list:
    """Activations the AVX2 build hands to its portable C: below 2^-119 (int4: 2^-114), near float32's largest,
    infinite."""
    # (cases[:4] are int4: below 2^-114 too, the v3 build scaling int4's activations down by up to 2^-12)
    out = [(x / x.abs().max() * 2.0 ** e, args) for e in (-121, -116, 125) for x, args, *_ in cases[:4]]
    inf = cases[0][0].clone()
    inf[0, 3] = float("inf")
    return out + [(inf, cases[0][1])]


def test_every_level_gives_the_portable_bits(monkeypatch):
    """The v4 (vdpbf16ps), v3 (float32 FMAs, a16_avx2.c) and portable builds, each forced: the same bits, the v3
    build in its AVX2 code for activations in its exact range and in its portable C for the others."""
    cases, far = level_cases(), extreme(level_cases())

    def run():
        lib = ops.library()
        before = lib.ki_a16_portable_calls()
        near = [product(x, args) for x, args, *_ in cases]
        middle = lib.ki_a16_portable_calls()
        outside = [product(x, args) for x, args in far]
        return near, outside, (middle - before, lib.ki_a16_portable_calls() - middle)

    outs = outputs_by_level(monkeypatch, run)
    assert "portable" in outs and len(outs) >= 2, f"only {list(outs)} run here"
    for level, (near, outside, _) in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(near, outs["portable"][0])), level
        assert all(torch.equal(a, b) or (a.isnan().any() and torch.equal(a.isnan(), b.isnan()))
                   for a, b in zip(outside, outs["portable"][1])), level
    if "v3" in outs:
        assert outs["v3"][2] == (0, len(far)), "the AVX2 path ran where it must not, or not where it should"


def test_applies_only_where_the_layout_does():
    w = torch.zeros(32, 96, dtype=torch.int8)
    assert a16_method.applies("cpu_int4_a16", w, torch.zeros(32, 3), 32, 4, False)
    assert a16_method.applies("cpu_int8_a16", w, torch.zeros(32, 1), 96, 8, False)
    assert a16_method.applies("cpu_int8_a16", w, torch.zeros(32, 3), 32, 8, False)  # grouped int8 too
    assert not a16_method.applies("cpu_int4_a16", w, torch.zeros(32, 6), 16, 4, False)  # groups of 16
    assert not a16_method.applies("cpu_int4_a16", w, torch.zeros(32, 1), 96, 8, False)  # int8 weight
    assert not a16_method.applies("cpu_int4_a16", torch.zeros(32, 40, dtype=torch.int8), torch.zeros(32, 1), 40, 4,
                                  False)  # inputs not a multiple of 32
