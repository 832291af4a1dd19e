"""The llama.cpp-arithmetic product (cpu_native ki_q8_0_linear) across its tiles: one row group of 16 outputs
times up to 8 tokens a tile (kernels_q8_0.c), so token counts around 8 (1, 3, 7, 8, 9, 16, 17, 33), outputs
not a multiple of 16, 32 inputs, groups of 32 / 64 / 128 / one a row, symmetric and asymmetric. Each token's
output is computed by the same integer sums and float operations whatever its tile, so it equals, bit for bit,
the token multiplied alone and the product on one thread; it matches the gguf package's Q8_0 reference; the
portable C build gives the same bits."""
from __future__ import annotations

import pytest
import torch
from native_builds import outputs_of_both_builds
from test_cpu_native_kernels import gguf_reference, grouped_case

from kubeinfer.engine.platforms.cpu.native import ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler: the native kernels do not build here")
# (tokens, inputs, outputs, bits, group (0: one a row), asymmetric)
TILE_CASES = [(1, 32, 17, 4, 32, True), (3, 1024, 33, 4, 128, False), (7, 256, 70, 8, 64, True),
              (8, 128, 16, 4, 64, True), (9, 96, 31, 8, 0, False), (16, 512, 48, 4, 128, True),
              (17, 64, 257, 8, 32, True), (33, 256, 40, 4, 0, False)]


def case(m, k, n, bits, group, asym):
    return grouped_case(m, k, n, bits, group or k, asym, seed=m * 31 + n)


@pytest.mark.parametrize("m,k,n,bits,group,asym", TILE_CASES)
def test_each_token_equals_itself_alone_and_on_one_thread(m, k, n, bits, group, asym):
    x, dense, args = case(m, k, n, bits, group, asym)
    x[m // 2] *= 1e3  # tokens of very different scales: a token given another's block scale is seen
    got = ops.q8_0_linear(x, *args)
    alone = torch.cat([ops.q8_0_linear(x[t:t + 1], *args) for t in range(m)])
    assert torch.equal(got, alone)
    threads = ops.set_threads(1)
    try:
        assert torch.equal(ops.q8_0_linear(x, *args), got)
    finally:
        ops.set_threads(ops.default_threads())
    assert threads == 1
    expected = gguf_reference(x, dense)
    assert ((got.double() - expected).abs().amax(1) <= 2e-6 * expected.abs().amax(1)).all()


def test_a_row_group_of_another_tile_is_seen():
    """The guard: a weight changed in the last output row (its own tile) changes that row only."""
    x, _, (packed, bits, scale, offset, group, n) = case(9, 64, 33, 8, 32, False)
    before = ops.q8_0_linear(x, packed, bits, scale, offset, group, n)
    w = ops.unpack_int8(packed, n, 64)
    w[32, 5] = w[32, 5] + (1 if w[32, 5] < 127 else -1)
    after = ops.q8_0_linear(x, ops.pack_int8(w), bits, scale, offset, group, n)
    assert torch.equal(after[:, :32], before[:, :32]) and not torch.equal(after[:, 32], before[:, 32])


def test_portable_build_equals_the_vnni_build_across_tiles(monkeypatch):
    native, portable = outputs_of_both_builds(
        monkeypatch, lambda: [ops.q8_0_linear(x, *args) for x, _, args in (case(*c) for c in TILE_CASES)])
    assert all(torch.equal(a, b) for a, b in zip(native, portable))
