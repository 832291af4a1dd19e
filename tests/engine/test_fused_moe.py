"""The MoE layer's experts: the CPU grouped path and the fused Triton kernels (under Triton's interpreter
without a GPU) against a reference written from the definition (each token through each of its k experts,
one at a time), with uneven loads: an expert no token chose and an expert every token chose. Also the
tensor-parallel slicing: the ranks' partial outputs sum to the unsliced layer's."""
from __future__ import annotations

import pytest
import torch
from test_triton_kernels import DEVICES  # also sets TRITON_INTERPRET=1 without CUDA, before triton loads

from kubeinfer.engine.model_executor.layers.fused_moe.activation import clamped_swiglu, silu_and_mul
from kubeinfer.engine.model_executor.layers.fused_moe.grouped import grouped_experts
from kubeinfer.engine.model_executor.layers.fused_moe.layer import FusedMoE
from kubeinfer.engine.model_executor.layers.fused_moe.router import softmax_topk, topk_softmax

E, H, I, K = 8, 32, 48, 2


def reference(x, gate_up, down, weights, ids, activation, gate_up_bias=None, down_bias=None):
    """Token by token, expert by expert: the definition, slow."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = gate_up[e] @ x[t] + (0 if gate_up_bias is None else gate_up_bias[e])
            y = down[e] @ activation(h[None])[0] + (0 if down_bias is None else down_bias[e])
            out[t] += weights[t, j] * y
    return out


def uneven_routing(num_tokens: int, seed: int):
    """Expert 3 in every token's choice, expert 6 in none, the rest random; weights from a softmax router."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(num_tokens, K, dtype=torch.long)
    ids[:, 0] = 3
    others = torch.tensor([0, 1, 2, 4, 5, 7])
    ids[:, 1] = others[torch.randint(0, len(others), (num_tokens,), generator=g)]
    weights = torch.softmax(torch.randn(num_tokens, K, generator=g), -1)
    return weights, ids


def random_experts(seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    biases = (torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)) if bias else (None, None)
    return gate_up, down, *biases


@pytest.mark.parametrize("num_tokens", [1, 5, 37])
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "clamped-swiglu-bias"])
def test_grouped_experts_match_the_definition(num_tokens, gpt_oss):
    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(num_tokens))
    gate_up, down, b1, b2 = random_experts(1, gpt_oss)
    weights, ids = uneven_routing(num_tokens, 2)
    activation = clamped_swiglu(1.702, 7.0) if gpt_oss else silu_and_mul
    got = grouped_experts(x, gate_up, down, weights, ids, activation, b1, b2)
    torch.testing.assert_close(got, reference(x, gate_up, down, weights, ids, activation, b1, b2),
                               atol=1e-5, rtol=1e-5)


def test_clamped_swiglu_is_gpt_oss_form():
    gate_up = torch.tensor([[10.0, -3.0, 9.0, -12.0]])  # gate [10, -3], up [9, -12]
    gate, up = torch.tensor([7.0, -3.0]), torch.tensor([7.0, -7.0])  # clamped: gate max 7, up to [-7, 7]
    want = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    torch.testing.assert_close(clamped_swiglu(1.702, 7.0)(gate_up)[0], want)


def test_routers():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = softmax_topk(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[1, 2]] and torch.allclose(w[0], probs[[1, 2]])
    w, _ = softmax_topk(logits, 2, renormalize=True)
    assert torch.allclose(w.sum(), torch.tensor(1.0))
    w, ids = topk_softmax(logits, 2)
    assert ids.tolist() == [[1, 2]] and torch.allclose(w[0], torch.softmax(torch.tensor([3.0, 2.0]), -1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens, block_m", [(1, 16), (9, 16), (40, 64)])
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "clamped-swiglu-bias"])
def test_fused_kernel_matches_torch_with_uneven_loads(device, num_tokens, block_m, gpt_oss):
    from kubeinfer.engine.model_executor.layers.fused_moe.triton_moe import fused_experts

    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(7))
    gate_up, down, b1, b2 = random_experts(3, gpt_oss)
    weights, ids = uneven_routing(num_tokens, 4)
    activation = clamped_swiglu(1.702, 7.0) if gpt_oss else silu_and_mul
    want = reference(x, gate_up, down, weights, ids, activation, b1, b2)
    on = [t.to(device) if t is not None else None for t in (x, gate_up, down, weights, ids, b1, b2)]
    got = fused_experts(*on[:5], gate_up_bias=on[5], down_bias=on[6], swiglu_limit=7.0 if gpt_oss else None,
                        block_m=block_m)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_alignment_pads_each_expert_to_whole_tiles(device):
    from kubeinfer.engine.model_executor.layers.fused_moe.triton_moe import align_by_expert

    ids = torch.tensor([[3, 0], [3, 7], [3, 0]], device=device)  # expert 3: 3 pairs, 0: 2, 7: 1, the rest none
    sorted_ids, expert_ids, padded = align_by_expert(ids, E, 16)
    assert int(padded) == 48
    sentinel = ids.numel()
    tiles = sorted_ids.view(-1, 16).cpu().tolist()
    assert [t for t in tiles[0] if t != sentinel] == [1, 5]  # expert 0's pairs, in order
    assert [t for t in tiles[1] if t != sentinel] == [0, 2, 4]
    assert [t for t in tiles[2] if t != sentinel] == [3]
    assert expert_ids[:3].tolist() == [0, 3, 7]


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_tensor_parallel_slices_sum_to_the_whole(tp_size, bias):
    """Each rank loads its slice of every expert's intermediate dimension from the full checkpoint tensors."""
    gate_up, down, b1, b2 = random_experts(5, bias)
    limit = 7.0 if bias else None

    def layer(rank: int, size: int) -> FusedMoE:
        moe = FusedMoE(E, H, I, bias=bias, swiglu_limit=limit, tp_rank=rank, tp_size=size)
        for e in range(E):  # per-expert gate and up (Qwen/Mixtral checkpoints), whole stacks for down
            moe.load_gate_or_up("gate", e, gate_up[e, :I])
            moe.load_gate_or_up("up", e, gate_up[e, I:])
        moe.load_down(None, down)
        if bias:
            moe.load_gate_up(None, b1, bias=True)
            moe.load_down(None, b2, bias=True)
        return moe

    x = torch.randn(11, H, generator=torch.Generator().manual_seed(8))
    weights, ids = uneven_routing(11, 9)
    whole = layer(0, 1)(x, weights, ids)
    torch.testing.assert_close(whole, reference(x, gate_up, down, weights, ids, whole_activation(limit), b1, b2),
                               atol=1e-5, rtol=1e-5)
    parts = [layer(r, tp_size)(x, weights, ids) for r in range(tp_size)]
    torch.testing.assert_close(sum(parts), whole, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(parts[0], whole)  # a rank alone holds only part of it


def whole_activation(limit):
    return silu_and_mul if limit is None else clamped_swiglu(1.702, limit)


def test_loading_a_wrong_shape_names_the_weight():
    moe = FusedMoE(E, H, I)
    with pytest.raises(ValueError, match=r"expert weight \(down\)"):
        moe.load_down(0, torch.zeros(H, I + 1))
    with pytest.raises(ValueError, match="does not split over 5"):
        FusedMoE(E, H, I, tp_size=5)


def test_grouped_path_runs_one_matmul_pair_per_active_expert(monkeypatch):
    """200 tokens over 3 active experts: 6 matmuls, however many tokens (no loop over tokens)."""
    from kubeinfer.engine.model_executor.layers.fused_moe import grouped

    calls = []
    real = grouped._product
    monkeypatch.setattr(grouped, "USE_GROUPED_MM", False)  # the per-expert path (torch without _grouped_mm)
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", "0")  # nor the native library's grouped product
    monkeypatch.setattr(grouped, "_product", lambda *a: calls.append(1) or real(*a))
    gate_up, down, _, _ = random_experts(6, False)
    ids = torch.tensor([[0, 4], [4, 7], [7, 0]] * 67)[:200]
    weights = torch.full(ids.shape, 0.5)
    x = torch.randn(200, H)
    got = grouped_experts(x, gate_up, down, weights, ids, silu_and_mul)
    assert len(calls) == 6
    torch.testing.assert_close(got[:3], reference(x[:3], gate_up, down, weights[:3], ids[:3], silu_and_mul))


def test_grouped_path_in_a_small_cpu_step():
    """In a small CPU step (platforms/cpu/cpu_blas.py: torch on one thread) the experts give the same results."""
    from kubeinfer.engine.platforms.cpu.cpu_blas import small_step

    gate_up, down, b1, b2 = random_experts(7, True)
    weights, ids = uneven_routing(13, 8)
    x = torch.randn(13, H)
    activation = clamped_swiglu(1.702, 7.0)
    with small_step(True):
        got = grouped_experts(x, gate_up, down, weights, ids, activation, b1, b2)
    torch.testing.assert_close(got, reference(x, gate_up, down, weights, ids, activation, b1, b2),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("biases", [False, True])
def test_grouped_mm_path_equals_the_per_expert_path(monkeypatch, biases):
    """torch's one grouped product per projection and the per-expert pairs give the same result, with an expert
    that no token chose and one that many did (uneven routing)."""
    from kubeinfer.engine.model_executor.layers.fused_moe import grouped

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    gate_up, down, b1, b2 = random_experts(7, biases)
    weights, ids = uneven_routing(13, 8)
    x = torch.randn(13, H)
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", "0")  # torch's grouped product, not the native library's
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = grouped_experts(x, gate_up, down, weights, ids, silu_and_mul, b1, b2)
    assert len(calls) == 2  # one per projection, whatever the number of experts
    monkeypatch.setattr(grouped, "USE_GROUPED_MM", False)
    torch.testing.assert_close(fused, grouped_experts(x, gate_up, down, weights, ids, silu_and_mul, b1, b2),
                               atol=1e-5, rtol=1e-5)
