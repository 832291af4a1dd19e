"""The native CPU kernels of a decode step's small ops (platforms/cpu/native/decode_ops.c through
platforms/cpu/cpu_fused_ops.py)
against torch and transformers: RMSNorm with its residual add, silu(gate) * up, rotary in place; then in the
engine, greedy tokens equal to transformers' with the kernels on, and KUBEINFER_CPU_NATIVE_LAYERS=0 taking torch.

Tolerances (measured: at most ~3 float32 ulps for the norm, ~2 for the activation): relative 6e-7 (5 ulps); the
bf16 norm within two bf16 ulps (one of bf16(s * inv)), on under 1% of the elements. The residual sum and the
rotation do torch's float operations, so they are compared bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kubeinfer.engine.platforms.cpu import cpu_fused_ops
from kubeinfer.engine.model_executor.layers.layernorm import RMSNorm
from kubeinfer.engine.platforms.cpu.native import ops
from kubeinfer.engine.model_executor.layers.rotary_embedding import RotaryEmbedding

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler: the native kernels do not build here")
RTOL = 6e-7  # 5 float32 ulps
TOKENS = (1, 16, 200)


@pytest.fixture(autouse=True)
def native_on(monkeypatch):
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", "1")


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, rtol=RTOL, atol=1e-30)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("width", [1024, 67])
@pytest.mark.parametrize("scale", [1.0, 1e-3])  # 1e-3: mean(x^2) ~ eps, so a dropped eps shows
def test_rms_norm_with_residual_matches_torch_and_transformers(tokens, width, scale):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(tokens + width)
    x, residual = torch.randn(tokens, width) * scale, torch.randn(tokens, width) * scale
    theirs = LlamaRMSNorm(width, eps=1e-6)
    with torch.no_grad():
        theirs.weight.normal_()
    out, summed = cpu_fused_ops.rms_norm(x, theirs.weight.detach(), 1e-6, residual)
    assert torch.equal(summed, x + residual)  # the new residual: one float add, torch's bits
    close(out, F.rms_norm(x + residual, (width,), theirs.weight.detach(), 1e-6))
    close(out, theirs(x + residual).detach())
    close(cpu_fused_ops.rms_norm(x, theirs.weight.detach(), 1e-6), theirs(x).detach())  # no residual: layer 0


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("width", [1024, 67])
def test_rms_norm_bf16_rounds_where_torch_rounds(tokens, width, monkeypatch):
    """bf16: s = x + r and y = w * bf16(s * inv) rounded as torch's bf16 ops (RMSNorm._norm, LlamaRMSNorm); only
    inv differs by float32 ulps, so a product near a rounding boundary may land one bf16 ulp away."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(tokens + width)
    x, residual = torch.randn(tokens, width).bfloat16(), torch.randn(tokens, width).bfloat16()
    theirs = LlamaRMSNorm(width, eps=1e-6).bfloat16()
    with torch.no_grad():
        theirs.weight.normal_()
    ours = RMSNorm(width, 1e-6).bfloat16()
    ours.weight.data.copy_(theirs.weight.data)
    out, summed = cpu_fused_ops.rms_norm(x, ours.weight.detach(), 1e-6, residual)
    assert out.dtype == summed.dtype == torch.bfloat16 and torch.equal(summed, x + residual)
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", "0")
    reference, _ = ours(x, residual)
    assert torch.equal(reference, theirs(x + residual))
    torch.testing.assert_close(out, reference, rtol=2 ** -6, atol=0)  # one ulp of bf16(s * inv), then w * it rounded
    assert (out != reference).float().mean() < 0.01


def test_rms_norm_per_head_on_a_strided_view():
    """Qwen3's q/k norms: [T, heads, head_dim] views into the fused qkv rows."""
    torch.manual_seed(3)
    qkv, weight = torch.randn(16, 24 * 64 + 8 * 64), torch.randn(64)
    q = qkv[:, :16 * 64].view(16, 16, 64)
    close(cpu_fused_ops.rms_norm(q, weight, 1e-6), F.rms_norm(q, (64,), weight, 1e-6))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("intermediate", [4096, 333])
def test_silu_mul_matches_torch(tokens, intermediate):
    torch.manual_seed(tokens)
    gate_up = torch.randn(tokens, 2 * intermediate) * 6
    gate, up = gate_up.split(intermediate, dim=-1)
    close(cpu_fused_ops.silu_mul(gate_up, intermediate), F.silu(gate) * up)


def test_silu_mul_at_the_extremes():
    g = torch.tensor([-200.0, -88.8, -87.5, -20.0, -1e-8, 0.0, 1e-30, 3.0, 88.0, 200.0, float("inf")])
    ours = cpu_fused_ops.silu_mul(torch.cat([g, torch.ones_like(g)])[None], g.numel())[0]
    torch.testing.assert_close(ours, F.silu(g), rtol=RTOL, atol=1e-36)
    nan = cpu_fused_ops.silu_mul(torch.tensor([[float("-inf"), float("nan"), 1.0, 1.0]]), 2)[0]
    assert nan.isnan().all() and F.silu(torch.tensor([float("-inf"), float("nan")])).isnan().all()


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("scaling", [{}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}])
def test_rotary_in_place_is_torchs_rotation_bit_for_bit(tokens, scaling):
    """q and k side by side in the fused qkv rows (llama.py's _rotate_side_by_side), rotated in place."""
    torch.manual_seed(tokens)
    rotary = RotaryEmbedding(64, 512, 10000.0, scaling)
    positions = torch.randint(0, 512, (tokens,))
    qkv = torch.randn(tokens, (16 + 8 + 8) * 64)
    qk = qkv[:, :24 * 64].reshape(tokens, 24, 64)
    reference = rotary.rotate(positions, qk.clone())
    v = qkv[:, 24 * 64:].clone()
    assert rotary.rotate_scratch(positions, qk).data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv[:, :24 * 64].reshape(tokens, 24, 64), reference)
    assert torch.equal(qkv[:, 24 * 64:], v)  # v untouched


def test_rotary_refuses_a_position_past_the_tables():
    rotary = RotaryEmbedding(64, 32, 10000.0, {})
    with pytest.raises(IndexError, match="max positions"):
        rotary.rotate_scratch(torch.tensor([3, 32]), torch.randn(2, 4, 64))


def test_unsupported_inputs_fall_back_to_torch():
    x, w = torch.randn(4, 64, dtype=torch.float16), torch.randn(64, dtype=torch.float16)
    assert cpu_fused_ops.rms_norm(x, w, 1e-6) is None
    assert cpu_fused_ops.rms_norm(x.bfloat16(), w.float(), 1e-6) is None  # mixed: torch promotes, we do not
    assert cpu_fused_ops.rms_norm(torch.randn(4, 64), torch.randn(64), 1e-6, torch.randn(64, 4).t()) is None
    assert cpu_fused_ops.silu_mul(torch.randn(4, 64).t(), 2) is None
    assert cpu_fused_ops.rotate_(torch.randn(2, 4, 64), torch.tensor([1, 2], dtype=torch.int32),
                                 torch.randn(8, 32), torch.randn(8, 32)) is None
    overlapping = torch.randn(2, 160).as_strided((2, 4, 64), (160, 32, 1))  # heads share values: not in place
    assert cpu_fused_ops.rotate_(overlapping, torch.tensor([1, 2]), torch.randn(8, 32), torch.randn(8, 32)) is None
    norm = RMSNorm(64, 1e-6).to(torch.float16)  # the module then runs torch's arithmetic
    torch.testing.assert_close(norm(x), (torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
                                         * x.float()).to(torch.float16) * norm.weight, rtol=0, atol=0)


def test_the_switch_off_means_no_native_call(monkeypatch):
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", "0")
    assert cpu_fused_ops.rms_norm(torch.randn(2, 64), torch.randn(64), 1e-6) is None
    assert cpu_fused_ops.silu_mul(torch.randn(2, 64), 32) is None


# ------------------------------------------------------------------ in the engine
def spy(monkeypatch) -> dict[str, int]:
    """Counts the calls the native kernels took (a None return is a fallback to torch)."""
    taken = {"rms_norm": 0, "silu_mul": 0, "rotate_": 0, "per_head_norm": 0}
    for name in ("rms_norm", "silu_mul", "rotate_"):
        real = getattr(cpu_fused_ops, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            out = _real(*args, **kwargs)
            taken[_name] += out is not None
            taken["per_head_norm"] += _name == "rms_norm" and out is not None and args[0].dim() == 3
            return out
        monkeypatch.setattr(cpu_fused_ops, name, counted)
    return taken


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_greedy_tokens_equal_transformers_with_native_ops(family, tmp_path, monkeypatch):
    from test_engine_correctness import MAX_TOKENS, PROMPTS, hf_greedy
    from transformers import AutoModelForCausalLM

    from kubeinfer.engine import LLM, SamplingParams
    from kubeinfer.dev.testing.random_model import build_random_model

    model_dir = build_random_model(tmp_path / family, family, tokenizer=False, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    for switch in ("1", "0"):
        monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", switch)
        taken = spy(monkeypatch)
        llm = LLM(str(model_dir), block_size=4, max_model_len=128)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].token_ids for o in outs] == expected, f"KUBEINFER_CPU_NATIVE_LAYERS={switch}"
        if switch == "1":  # the norms (Qwen3's per-head q/k norms too), activation and rotation went native
            assert taken["rms_norm"] and taken["silu_mul"] and taken["rotate_"], taken
            assert bool(taken["per_head_norm"]) == (family == "qwen3"), taken
        else:
            assert not any(taken.values()), taken
        monkeypatch.undo()


def test_engine_bf16_native_norms_keep_the_torch_paths_tokens(tmp_path, monkeypatch):
    """--dtype bfloat16: the norms go native (the activation and rotary stay torch's), greedy tokens unchanged. The
    switch also turns on the native decode attention, which in bf16 sums in float32 where torch's path runs bf16
    matmuls (other tokens on this random model): held on the torch path in both runs, to compare the norms alone."""
    from kubeinfer.engine.platforms.cpu import cpu_attention
    from test_engine_correctness import MAX_TOKENS, PROMPTS

    from kubeinfer.engine import LLM, SamplingParams
    from kubeinfer.dev.testing.random_model import build_random_model

    model_dir = build_random_model(tmp_path / "llama", "llama", tokenizer=False, seed=6)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    tokens = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", switch)
        taken = spy(monkeypatch)
        monkeypatch.setattr(cpu_attention, "usable", lambda *args: False)
        llm = LLM(str(model_dir), block_size=4, max_model_len=128, dtype="bfloat16")
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        tokens[switch] = [o.outputs[0].token_ids for o in outs]
        assert bool(taken["rms_norm"]) == (switch == "1") and not taken["silu_mul"] and not taken["rotate_"], taken
        monkeypatch.undo()
    assert tokens["1"] == tokens["0"]
