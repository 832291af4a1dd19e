"""The fused RMSNorm and rotary kernels (kubeinfer/engine/platforms/cuda/triton_norm.py) against the engine's
torch modules.

References are the modules the torch path runs: `RMSNorm` from models/llama.py and `RotaryEmbedding`
from rope.py. Inputs are column slices of wider tensors (as the model's qkv split gives), so a kernel
that ignored the row stride would read the wrong values. Without a GPU the kernels run in Triton's CPU
interpreter (test_triton_kernels sets TRITON_INTERPRET=1 at import when CUDA is absent).
"""
from __future__ import annotations

import pytest
import torch
from test_triton_kernels import DEVICES, DTYPES  # also sets TRITON_INTERPRET=1 without CUDA, before triton loads

from kubeinfer.engine.model_executor.layers.layernorm import RMSNorm
from kubeinfer.engine.model_executor.layers.rotary_embedding import RotaryEmbedding

EPS = 1e-6


def column_slice(rows: int, width: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """[rows, width] values in the middle of a wider tensor: row stride > width, last dim contiguous."""
    wide = torch.randn(rows, width + 40, device=device).to(dtype)
    return wide[:, 16:16 + width]


def reference_norm(n: int, dtype: torch.dtype, device: str) -> RMSNorm:
    norm = RMSNorm(n, EPS).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n) * 1.5 + 0.25)
    return norm


def assert_norm_matches(got: torch.Tensor, want: torch.Tensor, device: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:  # the sum of squares is added in another order than torch's
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    elif device == "cpu":  # bf16 in the interpreter: bit-exact (every rounding is torch's)
        assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} values differ"
    else:  # on a GPU the reduction order and rsqrt differ from torch's: allow one bf16 ulp
        torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)


# -- RMSNorm --------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [24, 512, 1000])
def test_rms_norm_matches_the_torch_module(device, dtype, n):
    from kubeinfer.engine.platforms.cuda.triton_norm import rms_norm

    torch.manual_seed(n)
    x = column_slice(7, n, dtype, device)
    norm = reference_norm(n, dtype, device)
    with torch.no_grad():
        want = norm(x)
    assert_norm_matches(rms_norm(x, norm.weight.detach(), EPS), want, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [24, 512, 1000])
def test_rms_norm_with_residual_returns_the_norm_of_the_sum_and_the_sum(device, dtype, n):
    from kubeinfer.engine.platforms.cuda.triton_norm import rms_norm

    torch.manual_seed(n + 1)
    x, residual = column_slice(6, n, dtype, device), column_slice(6, n, dtype, device)
    x_before, residual_before = x.clone(), residual.clone()
    norm = reference_norm(n, dtype, device)
    with torch.no_grad():
        want_sum = x + residual
        want = norm(want_sum)
    got, got_sum = rms_norm(x, norm.weight.detach(), EPS, residual=residual)
    assert torch.equal(got_sum, want_sum)  # one add, rounded once: exact everywhere
    assert_norm_matches(got, want, device)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs are not written


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_with_fp32_weight_promotes_like_torch(device):
    from kubeinfer.engine.platforms.cuda.triton_norm import rms_norm

    torch.manual_seed(3)
    x = column_slice(5, 40, torch.bfloat16, device)
    norm = reference_norm(40, torch.float32, device)  # weight fp32, activations bf16: the result is fp32
    with torch.no_grad():
        want = norm(x)
    got = rms_norm(x, norm.weight.detach(), EPS)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- rotary embedding -----------------------------------------------------------------------------
ROPES = {
    "default": (10000.0, {}),
    "llama3": (500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 24, 64])  # 24: half of it (12) is padded inside the kernel
@pytest.mark.parametrize("rope", list(ROPES))
def test_apply_rotary_matches_rotary_embedding_in_place(device, dtype, head_dim, rope):
    from kubeinfer.engine.platforms.cuda.triton_norm import apply_rotary

    torch.manual_seed(head_dim)
    tokens, heads, kv_heads, max_positions = 9, 4, 2, 256
    theta, scaling = ROPES[rope]
    rotary = RotaryEmbedding(head_dim, max_positions, theta, scaling).to(device)
    # q, k, v as the model has them: column views of one fused projection output (row stride > H * D).
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    q = qkv[:, :q_end].view(tokens, heads, head_dim)
    k = qkv[:, q_end:k_end].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, k_end:].clone()
    positions = torch.randint(0, max_positions, (tokens,), device=device)
    want_q, want_k = rotary(positions, q, k)

    got_q, got_k = apply_rotary(q, k, positions, rotary.cos, rotary.sin)
    # The same fp32 operations in the same order, each rounded once (no FMA): exact in both dtypes.
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # rotated in place
    assert torch.equal(qkv[:, k_end:], v_before)  # v, beside them in the same rows, is untouched


# -- empty batches --------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_no_rows_returns_empty_results_without_launching(device, monkeypatch):
    from kubeinfer.engine.platforms.cuda import triton_norm

    monkeypatch.setattr(triton_norm, "_rms_norm_kernel", None)  # a launch would fail on these
    monkeypatch.setattr(triton_norm, "_rotary_kernel", None)
    x = torch.empty(0, 64, device=device, dtype=torch.bfloat16)
    weight = torch.ones(64, device=device, dtype=torch.bfloat16)
    out = triton_norm.rms_norm(x, weight, EPS)
    out2, summed = triton_norm.rms_norm(x, weight, EPS, residual=torch.empty_like(x))
    assert out.shape == out2.shape == summed.shape == (0, 64)
    rotary = RotaryEmbedding(16, 32, 10000.0, {}).to(device)
    qkv = torch.empty(0, 8 * 16, device=device, dtype=torch.bfloat16)
    q, k = qkv[:, :64].view(0, 4, 16), qkv[:, 64:96].view(0, 2, 16)
    got_q, got_k = triton_norm.apply_rotary(q, k, torch.empty(0, dtype=torch.long, device=device),
                                            rotary.cos, rotary.sin)
    assert got_q.shape == (0, 4, 16) and got_k.shape == (0, 2, 16)
