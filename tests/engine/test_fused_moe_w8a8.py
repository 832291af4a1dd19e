"""W8A8 inside the MoE experts, at the layer (issue 29; the checkpoints end to end: test_quantized_moe_w8a8.py):
the experts' CPU grouped path (torch._grouped_mm and the per-expert fallback) and the Triton kernels (under
TRITON_INTERPRET=1 without a GPU, tests/conftest.py) with their inputs quantized (layers/fused_moe/
expert_input_quant.py), against the definition written token by token and expert by expert, each input
fake-quantized by the compressed-tensors package; each (token, expert) row bit for bit the package's; and
the unserved expert schemes refused by name (layers/quantization/w8a8_experts.py)."""
from __future__ import annotations

import pytest
import torch
from quant_checkpoints import ct_activation_args, ct_fake_quantize

# --- The kernels: CPU grouped (torch._grouped_mm and the per-expert fallback) and Triton, against the
# definition (token by token, expert by expert, each input fake-quantized by the package) ---
E, H, INTER, K = 8, 32, 48, 2  # test_fused_moe.random_experts' shapes
KERNEL_SCHEMES = {  # name: (ActivationScheme fields, static scales: None, "shared" or "per_expert")
    "fp8_group_dynamic": (dict(type="float", strategy="group", dynamic=True, group_size=16), None),
    "int8_token_dynamic_asym": (dict(type="int", strategy="token", dynamic=True, symmetric=False), None),
    "int8_static_asym_per_expert": (dict(type="int", strategy="tensor", dynamic=False, symmetric=False),
                                    "per_expert"),
    "fp8_static_shared": (dict(type="float", strategy="tensor", dynamic=False), "shared"),
}


def expert_quant(name: str):
    """(ExpertInputQuant, args_of(projection, expert) -> (QuantizationArgs, scale, zero)) for a scheme."""
    from kubeinfer.engine.model_executor.layers.quantization.expert_input_quant import ExpertInputQuant
    from kubeinfer.engine.model_executor.layers.quantization.activations import ActivationScheme

    fields, static = KERNEL_SCHEMES[name]
    scheme = ActivationScheme(fields["type"], fields["strategy"], fields["dynamic"], fields.get("symmetric", True),
                              fields.get("group_size"))
    args = ct_activation_args(**fields)
    g = torch.Generator().manual_seed(11)
    scales = {}
    if static:
        for which, size in (("gate_up", 0.03), ("down", 0.004)):
            scale = size * (0.5 + torch.rand(E if static == "per_expert" else 1, generator=g))
            zero = None if scheme.symmetric else torch.randint(-20, 20, scale.shape, generator=g).to(torch.int8)
            scales[which] = (scale, zero)

    def args_of(projection: str, expert: int):
        if not static:
            return args, None, None
        scale, zero = scales["gate_up" if projection == "gate_up_proj" else "down"]
        e = expert if scale.numel() > 1 else 0
        return args, scale[e:e + 1], None if zero is None else zero[e:e + 1]
    return ExpertInputQuant(scheme, scheme, scales), args_of


def quantized_definition(x, gate_up, down, weights, ids, args_of):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            xq = ct_fake_quantize(x[t][None, None], *args_of("gate_up_proj", e))[0, 0]
            gate, up = (gate_up[e] @ xq).chunk(2)
            act = ct_fake_quantize((torch.nn.functional.silu(gate) * up)[None, None], *args_of("down_proj", e))[0, 0]
            out[t] += weights[t, j] * (down[e] @ act)
    return out


def kernel_inputs(num_tokens: int):
    from test_fused_moe import random_experts, uneven_routing

    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(num_tokens)) * 2
    gate_up, down, _, _ = random_experts(1, False)
    weights, ids = uneven_routing(num_tokens, 2)
    return x, gate_up, down, weights, ids


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "per_expert"])
@pytest.mark.parametrize("name", list(KERNEL_SCHEMES))
def test_grouped_experts_quantize_inputs_as_the_definition(monkeypatch, name, grouped_mm):
    from kubeinfer.engine.model_executor.layers.fused_moe import grouped
    from kubeinfer.engine.model_executor.layers.fused_moe.activation import silu_and_mul

    monkeypatch.setattr(grouped, "USE_GROUPED_MM", grouped_mm and grouped.USE_GROUPED_MM)
    quant, args_of = expert_quant(name)
    x, gate_up, down, weights, ids = kernel_inputs(13)
    got = grouped.grouped_experts(x, gate_up, down, weights, ids, silu_and_mul, input_quant=quant)
    want = quantized_definition(x, gate_up, down, weights, ids, args_of)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    plain = grouped.grouped_experts(x, gate_up, down, weights, ids, silu_and_mul)
    assert (plain - want).abs().max() > 1e-3  # the guard: unquantized inputs are measurably off


@pytest.mark.parametrize("name", list(KERNEL_SCHEMES))
def test_expert_rows_quantized_bit_for_bit_as_the_package(name):
    """Each (token, expert) row, with its expert's scale, is what the package gives that expert's layer."""
    quant, args_of = expert_quant(name)
    x, _, _, _, ids = kernel_inputs(13)
    experts = ids.reshape(-1)
    rows = x.repeat_interleave(K, dim=0)
    hidden = quant.hidden(x)
    shared = hidden is not None
    got = {"gate_up_proj": hidden.repeat_interleave(K, dim=0) if shared else quant.hidden_rows(rows, experts),
           "down_proj": quant.intermediate(rows, experts)}
    for projection, quantized in got.items():
        for p, e in enumerate(experts.tolist()):
            assert torch.equal(quantized[p], ct_fake_quantize(rows[p][None, None], *args_of(projection, e))[0, 0])


@pytest.mark.parametrize("name", ["fp8_group_dynamic", "int8_static_asym_per_expert"])
def test_triton_experts_quantize_inputs_as_the_grouped_path(name):
    """Under TRITON_INTERPRET=1 (tests/conftest.py) without a GPU; tiny sizes."""
    from test_triton_kernels import HAS_TRITON, INTERPRETER

    if not (HAS_TRITON and (INTERPRETER or torch.cuda.is_available())):
        pytest.skip("triton with its interpreter or a GPU")
    from kubeinfer.engine.model_executor.layers.fused_moe.activation import silu_and_mul
    from kubeinfer.engine.model_executor.layers.fused_moe.grouped import grouped_experts
    from kubeinfer.engine.model_executor.layers.fused_moe.triton_moe import fused_experts

    device = "cpu" if INTERPRETER else "cuda"
    quant, args_of = expert_quant(name)
    x, gate_up, down, weights, ids = kernel_inputs(9)
    want = quantized_definition(x, gate_up, down, weights, ids, args_of)
    on = [t.to(device) for t in (x, gate_up, down, weights, ids)]
    got = fused_experts(*on, block_m=16, input_quant=quant.to(device))
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.cpu(), grouped_experts(x, gate_up, down, weights, ids, silu_and_mul,
                                                          input_quant=quant), atol=1e-4, rtol=1e-4)


# --- What is not served is refused by name ---
class _OneMoELayer(torch.nn.Module):
    """What ExpertSchemes reads of a model: `expert_of` and the experts (2 experts, hidden 16, intermediate 64)."""

    def __init__(self, tp_size: int = 1):
        from kubeinfer.engine.model_executor.layers.fused_moe.layer import FusedMoE

        super().__init__()
        self.experts = FusedMoE(2, 16, 64, tp_size=tp_size)

    def expert_of(self, name: str):
        _, expert, projection, _ = name.rsplit(".", 3)
        return "experts", int(expert), projection


def _schemes(model, entries: dict):
    """entries: (expert, projection) -> (ActivationScheme, scale or None)."""
    from kubeinfer.engine.model_executor.layers.quantization.w8a8_experts import ExpertSchemes

    schemes = ExpertSchemes(model)
    for (e, p), (scheme, scale) in entries.items():
        static = (None, None) if scale is None else (torch.tensor([scale]), None)
        assert schemes.take(f"experts.{e}.{p}.weight", f"experts.{e}.{p}", scheme, lambda s=static: s)
    return schemes.install()


@pytest.mark.parametrize("case, message", [
    ("gate_up_scales_differ", "experts.1.gate_proj and experts.1.up_proj have different static input scales"),
    ("mixed", r"some experts' down_proj quantize their input activations and others' do not \(expert 1 down_proj\)"),
    ("schemes_differ", "the experts' down_proj quantize their input differently"),
    ("tensor_parallel_group_cut", "each rank holds 32 of the experts' intermediate columns, which cut a group of 24"),
])
def test_unserved_expert_activation_schemes_are_refused_by_name(case, message):
    from kubeinfer.engine.model_executor.layers.quantization import QuantizationError
    from kubeinfer.engine.model_executor.layers.quantization.activations import ActivationScheme

    static = ActivationScheme("int", "tensor", dynamic=False)
    token = ActivationScheme("int", "token", dynamic=True)
    entries = {(e, p): (static, 0.01) for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")}
    if case == "gate_up_scales_differ":
        entries[(1, "up_proj")] = (static, 0.02)
    elif case == "mixed":
        del entries[(1, "down_proj")]
    elif case == "schemes_differ":
        entries[(1, "down_proj")] = (token, None)
    else:
        entries = {key: (ActivationScheme("float", "group", True, group_size=24), None) for key in entries}
    with pytest.raises(QuantizationError, match=message):
        _schemes(_OneMoELayer(tp_size=2 if case.startswith("tensor_parallel") else 1), entries)


def test_served_expert_schemes_are_described_and_static_scales_kept_per_expert():
    from kubeinfer.engine.model_executor.layers.quantization import w8a8_tp
    from kubeinfer.engine.model_executor.layers.quantization.activations import ActivationScheme

    static, group = ActivationScheme("int", "tensor", dynamic=False), ActivationScheme("float", "group", True, True, 16)
    model = _OneMoELayer()
    entries = {(e, p): (static, 0.01 * (e + 1)) for e in range(2) for p in ("gate_proj", "up_proj")}
    installed = _schemes(model, {**entries, **{(e, "down_proj"): (group, None) for e in range(2)}})
    described = "gate/up int8 static per tensor, down fp8 e4m3 dynamic per group of 16 (fused experts)"
    assert installed == {"experts": described}
    assert model.experts.input_quant.gate_up_input_scale.tolist() == pytest.approx([0.01, 0.02])
    tp = _OneMoELayer(tp_size=2)  # groups of 16 tile a rank's 32 columns: served under tensor parallelism
    assert _schemes(tp, {(e, p): (group, None) for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")})
    assert tp.experts.input_quant.ranges == {"gate_up": None, "down": None}  # exact locally
    tp = _OneMoELayer(tp_size=2)  # per token: the down input's range made whole over the ranks
    token = ActivationScheme("int", "token", True)
    assert _schemes(tp, {(e, p): (token, None) for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")})
    assert tp.experts.input_quant.ranges == {"gate_up": None, "down": w8a8_tp.whole_token_range}
