"""The native float32 product (platforms/cpu/native/f32_linear.c, f32_ops.py) and the lm_head that uses it
(platforms/cpu/native_lm_head.py): within float32's rounding of torch's float64 product, the portable C twin giving the
AVX-512 build's bits, a token's outputs independent of the batch and the thread count, and an engine whose greedy
tokens equal transformers' with the switch on and off."""
from __future__ import annotations

import math

import pytest
import torch
from native_builds import outputs_by_level, outputs_of_both_builds

from kubeinfer.engine.platforms.cpu.native import f32_ops, ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="native CPU kernels not built (no C compiler)")

# K not a multiple of the 16 lanes, N not a multiple of a tile's 4 rows nor a work item's 8
SHAPES = [(1, 37, 20), (3, 50, 33), (16, 101, 1000), (33, 17, 47), (16, 64, 1024), (1, 8, 16), (5, 3, 7)]


def case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)


def within_float32(ours: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|ours - exact| <= (ceil(K / 16) + 4) u sum|x w| (u = 2**-24): the rounding bound of 16 lanes of ceil(K / 16)
    fused multiply-adds each, then a tree of 4 additions."""
    exact = x.double() @ w.double().T
    bound = (math.ceil(x.shape[1] / 16) + 4) * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    excess = (ours.double() - exact).abs() - bound
    where = divmod(excess.argmax().item(), ours.shape[1])
    assert excess.max().item() <= 0, f"{excess.max().item():.3g} past the bound at {where}"


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_product_within_float32_of_the_float64_product(m, n, k):
    x, w = case(m, n, k)
    ours = f32_ops.f32_linear(x, w)
    assert ours.shape == (m, n) and ours.dtype == torch.float32
    within_float32(ours, x, w)


def test_the_bound_sees_a_dropped_input():
    """The check above fails on a product that leaves out one input column (as a kernel dropping its K tail would)."""
    x, w = case(16, 101, 1000)
    dropped = (x[:, :-1].double() @ w[:, :-1].double().T).float()
    with pytest.raises(AssertionError):
        within_float32(dropped, x, w)


def test_batch_and_threads_do_not_change_a_tokens_bits():
    """Row i of an M-token product equals the one-token product of row i, and the calling thread alone gives the
    pool's bits: each output's sum has one order."""
    for m, n, k in [(16, 101, 1000), (33, 2048, 64), (16, 300, 47)]:
        x, w = case(m, n, k, seed=1)
        whole = f32_ops.f32_linear(x, w)
        assert torch.equal(torch.cat([f32_ops.f32_linear(x[i:i + 1], w) for i in range(m)]), whole)
        assert torch.equal(f32_ops.f32_linear(x, w, threads=1), whole)
        assert torch.equal(f32_ops.f32_linear(x[5:9], w), whole[5:9])


def test_leading_dims_and_a_strided_input():
    x, w = case(6, 40, 24)
    assert torch.equal(f32_ops.f32_linear(x.view(2, 3, 24), w), f32_ops.f32_linear(x, w).view(2, 3, 40))
    wide = torch.randn(6, 48)
    wide[:, ::2] = x
    assert torch.equal(f32_ops.f32_linear(wide[:, ::2], w), f32_ops.f32_linear(x, w))


def test_portable_build_equals_the_avx512_build(monkeypatch):
    """KUBEINFER_CPU_NATIVE_PORTABLE=1 builds the plain C twin: the same bits."""
    native, portable = outputs_of_both_builds(
        monkeypatch, lambda: [f32_ops.f32_linear(*case(m, n, k, seed=2)) for m, n, k in SHAPES], check_vnni=False)
    for a, b in zip(native, portable):
        assert torch.equal(a, b)



def test_every_level_gives_the_portable_bits(monkeypatch):
    """The v4 (AVX-512), v3 (AVX2: two 8-lane halves) and portable builds, each forced: the same bits."""
    outs = outputs_by_level(monkeypatch, lambda: [f32_ops.f32_linear(*case(m, n, k, seed=3)) for m, n, k in SHAPES])
    assert "portable" in outs and len(outs) >= 2, f"only {list(outs)} run here"
    for level, products in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(products, outs["portable"])), level


# ------------------------------------------------------------------ in the engine
@pytest.mark.parametrize("tied", [False, True])
def test_engine_greedy_tokens_equal_transformers_with_the_native_lm_head(tied, tmp_path, monkeypatch):
    from test_engine_correctness import MAX_TOKENS, PROMPTS, hf_greedy
    from transformers import AutoModelForCausalLM

    from kubeinfer.engine import LLM, SamplingParams
    from kubeinfer.dev.testing.random_model import build_random_model

    model_dir = build_random_model(tmp_path / "llama", "llama", tokenizer=False, seed=7, vocab_size=203,
                                   tie_word_embeddings=tied)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    for switch in ("1", "0"):
        monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", switch)
        calls = []
        real = f32_ops.f32_linear
        monkeypatch.setattr(f32_ops, "f32_linear", lambda x, w, *a: calls.append(w.shape) or real(x, w, *a))
        llm = LLM(str(model_dir), block_size=4, max_model_len=128)
        if tied:
            model = llm.engine.runner.model
            assert model.lm_head.weight is model.model.embed_tokens.weight
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].token_ids for o in outs] == expected, f"KUBEINFER_CPU_NATIVE_LAYERS={switch}"
        # the lm_head (203 rows) at every step; the projections of the 2-16-token steps too (cpu_blas.py)
        assert any(s[0] == 203 for s in calls) == (switch == "1") and bool(calls) == (switch == "1"), calls
        monkeypatch.undo()
