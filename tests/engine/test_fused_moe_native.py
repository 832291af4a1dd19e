"""The experts' float32 products on the native library (fused_moe/native_grouped.py, ki_f32_grouped_linear): every
expert's rows in one call, each row summed as the dense ki_f32_linear sums it (the same bits), the decode step's
experts taking it, its bounds refused, and prefill-sized groups left to torch's GEMM."""
from __future__ import annotations

import pytest
import torch

from kubeinfer.engine.model_executor.layers.fused_moe import grouped, native_grouped
from kubeinfer.engine.model_executor.layers.fused_moe.activation import silu_and_mul
from kubeinfer.engine.model_executor.layers.fused_moe.grouped import grouped_experts
from kubeinfer.engine.platforms.cpu.native import f32_ops, ops

pytestmark = pytest.mark.skipif(ops.library() is None, reason="no native library built")

E, H, I, K = 6, 40, 24, 2  # H, 2I not multiples of the kernel's 16 lanes or 8-row groups


def sorted_rows(counts: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(E, 2 * I, H, generator=g)
    x = torch.randn(sum(counts), H, generator=g)
    return x, weights, torch.tensor(counts).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("counts", [[1, 0, 3, 0, 0, 1], [0, 0, 0, 0, 0, 5], [7, 2, 9, 1, 0, 4], [0] * E])
def test_each_expert_rows_equal_the_dense_native_product_bit_for_bit(counts):
    x, weights, ends = sorted_rows(counts)
    got = native_grouped.grouped_linear(x, weights, ends)
    start = 0
    for e, n in enumerate(counts):
        if n:
            assert torch.equal(got[start:start + n], f32_ops.f32_linear(x[start:start + n], weights[e]))
        start += n
    torch.testing.assert_close(got, torch._grouped_mm(x, weights.transpose(1, 2), offs=ends), atol=1e-5, rtol=1e-5)


def test_ends_that_do_not_fit_are_refused_and_nothing_written():
    x, weights, _ = sorted_rows([2, 1, 0, 0, 0, 1])
    for bad in ([2, 1, 3, 3, 3, 4], [2, 3, 3, 3, 3, 5], [2, 3, 3, 3, 3, 3]):  # decreasing, past M, short of M
        with pytest.raises(ops.NativeArgumentError):
            native_grouped.grouped_linear(x, weights, torch.tensor(bad, dtype=torch.int32))


def test_a_decode_step_takes_the_native_product_and_prefill_groups_keep_torch(monkeypatch):
    g = torch.Generator().manual_seed(1)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    calls = []
    real = native_grouped.grouped_linear
    monkeypatch.setattr(native_grouped, "grouped_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for tokens, native in ((4, True), (native_grouped.MAX_ROWS_PER_EXPERT + 1, False)):
        calls.clear()
        logits = torch.randn(tokens, E, generator=g)
        weights, ids = torch.softmax(logits, -1).topk(K, -1)
        x = torch.randn(tokens, H, generator=g)
        ids[:, 0] = 2  # one expert in every token's choice: past the bound when tokens exceed it
        ids[:, 1] = torch.where(ids[:, 1] == 2, 3, ids[:, 1])
        got = grouped_experts(x, gate_up, down, weights, ids, silu_and_mul)
        assert calls == ([tokens * K] * 2 if native else [])  # one call per projection
        monkeypatch.setattr(grouped, "USE_GROUPED_MM", False)
        torch.testing.assert_close(got, grouped_experts(x, gate_up, down, weights, ids, silu_and_mul),
                                   atol=1e-5, rtol=1e-5)
        monkeypatch.setattr(grouped, "USE_GROUPED_MM", True)
