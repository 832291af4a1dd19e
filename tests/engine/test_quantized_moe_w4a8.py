"""MoE experts of W4A8 and W8A8 int8 checkpoints (int4 / int8 weights, symmetric; int8 dynamic per-token symmetric
input activations) on the dense layers' exact integer kernels (layers/fused_moe/a8_experts.py): `w4a8_vnni`,
`int8_vnni`, and their torch._int_mm twins. Before, these experts were dequantized into float32 stacks and their
inputs fake-quantized (test_quantized_moe_w8a8.py's reference computation).

References nobody here wrote: transformers loading the W4A8 checkpoint the `compressed-tensors` package wrote, with
`CompressedTensorsConfig()` (the package decompresses the experts into transformers' stacked weights and wraps each
quantized nn.Linear, fake-quantizing its input per token). transformers' Qwen3-MoE experts are no nn.Linear, so
the package leaves their inputs in float: as test_quantized_moe_w8a8.py does, each expert's F.linear input is
fake-quantized by the package's functions with the checkpoint's input_activations (per token, the hidden state
as a [1, tokens, hidden] input; down's input per (token, expert) row). Plain `CompressedTensorsConfig()` (experts'
inputs float) is measured too: it is the guard (the engine is nearer the quantized reference). W8A8 int8: the
package's decompression loaded as a float model, inputs fake-quantized alike (test_quantized_moe_w8a8's
ct_moe_reference). One expert's product is bit-equal to the dense W4A8 / W8A8 method on the same weights."""
from __future__ import annotations

import pytest
import test_quantized_moe_w8a8
import torch
from native_builds import outputs_of_both_builds
from quant_checkpoints import (
    assert_greedy_equal_but_near_ties,
    ct_activation_args,
    ct_compress,
    ct_scheme,
    engine_greedy,
    float_weights,
    hf_greedy,
    write_checkpoint,
)
from test_quantized_moe_a16 import assert_batch_invariant, expert, stacks
from test_quantized_moe_w8a8 import ROUTERS, ct_moe_checkpoint, ct_moe_reference, quantize_expert_inputs
from test_quantized_w4a8 import MAX_GAP, MEAN_GAP, first_logprob_gaps, hf_w4a8
from torch import nn

from kubeinfer.engine import LLM
from kubeinfer.engine.model_executor.layers.fused_moe import a8_experts
from kubeinfer.engine.model_executor.layers.fused_moe.int_experts import ExpertsIntMethod, choose_expert_kernel
from kubeinfer.engine.model_executor.layers.fused_moe.layer import FusedMoE
from kubeinfer.engine.model_executor.layers.quantization import w4a8, w8a8
from kubeinfer.engine.model_executor.layers.quantization.activations import ActivationScheme
from kubeinfer.engine.platforms.cpu.native import ops
from kubeinfer.engine.model_executor.layers.quantization.linear_method import dense as dense_product

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler: the native kernels do not build")
float_dirs = test_quantized_moe_w8a8.float_dirs  # its random models (hidden 64), module-scoped
CPU = torch.device("cpu")
TOKEN = ActivationScheme("int", "token", True, True)
TOKEN_ARGS = dict(type="int", strategy="token", dynamic=True, symmetric=True)


@pytest.fixture(autouse=True)
def default_kernels(monkeypatch):
    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    monkeypatch.delenv("KUBEINFER_W8A8_KERNEL", raising=False)


def w4a8_moe_checkpoint(float_dir, dst, group: int | None = 32) -> str:
    """llm-compressor's W4A8 on every decoder projection, the experts' included, routers float."""
    config = ct_scheme("pack-quantized", 4, "int", "group" if group else "channel", True, group, activations=True,
                       ignore=ROUTERS[float_dir.name])
    config["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "observer": None, **TOKEN_ARGS}
    return write_checkpoint(float_dir, dst, ct_compress(float_weights(float_dir), config), config)


def w4a8_moe_reference(model_dir, quantize_experts: bool = True):
    """transformers with CompressedTensorsConfig() and, unless told not to, each expert's inputs fake-quantized by
    the package per token (module docstring)."""
    model = hf_w4a8(model_dir)
    with torch.no_grad():  # the package's wrapper sets itself up at the first forward, before experts are wrapped
        model(torch.tensor([[1]]))
    args = ct_activation_args(**TOKEN_ARGS)
    if quantize_experts:
        quantize_expert_inputs(model, lambda layer, projection, e: (args, None, None))
    else:
        model.set_experts_implementation("eager")
    return model


def packed_bytes(moe: FusedMoE) -> int:
    return sum(p.numel() * p.element_size() for p in moe.parameters() if p.device.type != "meta")


# Largest / mean first-token log-prob gap to the reference, measured (2026-11-27): per channel 0.033 / 0.009
# (KUBEINFER_W8A8_KERNEL=fake_quant, the reference's own float computation in the engine: 0.045 / 0.008); groups
# of 32: 0.152 / 0.016 (fake_quant: 0.306 / 0.024: one token's rounding moves an activation across an int8
# rounding boundary). The reference with the experts' inputs float: 0.40 / 0.078 and 0.25 / 0.058 (the guard).
GAPS = {None: (MAX_GAP, MEAN_GAP), 32: (0.2, MEAN_GAP)}


@pytest.mark.parametrize("group", [pytest.param(None, id="channel", marks=pytest.mark.slow), 32])
def test_w4a8_moe_experts_run_the_int4_product_and_give_the_references_tokens(float_dirs, tmp_path, group):
    """Every layer's experts through w4a8_vnni, held packed (half a byte a weight and a float32 scale per row and
    group, rows padded to 16; no float stack); greedy tokens the reference's, near ties excused; the first token's
    top-5 log-probabilities within GAPS of the reference's, the mean outside them for the reference whose
    experts' inputs stay float."""
    model_dir = w4a8_moe_checkpoint(float_dirs("qwen3_moe"), tmp_path / "w4a8", group)
    llm = LLM(model_dir, max_model_len=128, num_kv_blocks=64)
    model = llm.engine.runner.model
    assert set(model.expert_kernels.values()) == {"w4a8_vnni"}
    for moe in model.experts_modules().values():
        assert moe.gate_up_proj.device.type == "meta" and moe.down_proj.device.type == "meta"
        e, n, k = moe.gate_up_proj.shape
        _, h, i = moe.down_proj.shape
        rows, size = (lambda r: -(-r // 16) * 16), group or k  # hidden = intermediate here: one group size
        assert packed_bytes(moe) == e * (rows(n) * (k // 2 + 4 * k // size) + rows(h) * (i // 2 + 4 * i // size))
    reference = w4a8_moe_reference(model_dir)
    largest, mean = first_logprob_gaps(llm, reference)
    float_largest, float_mean = first_logprob_gaps(llm, w4a8_moe_reference(model_dir, quantize_experts=False))
    print(f"W4A8 MoE group {group}: first-token log-prob gaps to the reference: largest {largest:.4f}, mean "
          f"{mean:.4f}; to the reference with float expert inputs: {float_largest:.4f} / {float_mean:.4f}")
    llm.shutdown()
    max_gap, mean_gap = GAPS[group]
    assert largest <= max_gap and mean <= mean_gap
    assert float_mean > mean_gap
    assert_greedy_equal_but_near_ties(engine_greedy(model_dir), hf_greedy(reference), reference, tie=max_gap)


def test_w8a8_int8_moe_experts_run_the_int8_product_and_give_the_references_tokens(float_dirs, tmp_path):
    float_dir = float_dirs("qwen3_moe")
    model_dir = ct_moe_checkpoint(float_dir, "int8_dynamic", tmp_path / "ct")
    llm = LLM(model_dir, max_model_len=128, num_kv_blocks=64)
    model = llm.engine.runner.model
    assert set(model.expert_kernels.values()) == {"int8_vnni"}
    moe = next(iter(model.experts_modules().values()))
    e, n, k = moe.gate_up_proj.shape
    assert moe.gate_up_qweight.dtype == torch.uint8 and moe.gate_up_qweight.numel() == e * -(-n // 16) * 16 * k
    llm.shutdown()
    reference = ct_moe_reference(model_dir, float_dir, tmp_path / "dense")
    assert_greedy_equal_but_near_ties(engine_greedy(model_dir), hf_greedy(reference), reference)


def test_the_int_mm_twins_give_the_native_kernels_tokens(float_dirs, tmp_path, monkeypatch):
    """KUBEINFER_W8A8_KERNEL=int_mm: the experts (and dense layers) through torch._int_mm, the same bits."""
    model_dir = w4a8_moe_checkpoint(float_dirs("qwen3_moe"), tmp_path / "w4a8")
    native = engine_greedy(model_dir)
    monkeypatch.setenv("KUBEINFER_W8A8_KERNEL", "int_mm")
    llm = LLM(model_dir, max_model_len=64, num_kv_blocks=16)
    assert set(llm.engine.runner.model.expert_kernels.values()) == {"w4a8_int_mm"}
    llm.shutdown()
    assert engine_greedy(model_dir) == native


def int_stacks(bits: int, group: int, experts: int = 4, hidden: int = 256, inter: int = 128):
    return stacks(bits, group, False, experts=experts, hidden=hidden, inter=inter)


def kept_layer(weights: dict, kernel: str) -> FusedMoE:
    moe = FusedMoE(weights["gate_up"].values.shape[0], weights["down"].values.shape[1],
                   weights["down"].values.shape[2])
    moe.int_method = ExpertsIntMethod(moe, weights, kernel, torch.float32)
    return moe


def dense_method(weight, kernel: str):
    """The dense layer's W4A8 / W8A8 method on one expert's weight (w4a8.py, w8a8.py), with its layer."""
    n, k = weight.values.shape
    layer = nn.Linear(k, n, bias=False)
    if weight.bits == 4:
        return layer, w4a8.W4A8Method(layer, TOKEN, weight, kernel)
    layer.weight.data = weight.dequantize()
    int_mm = (weight.values.t().contiguous(), weight.scale[:, 0].contiguous())
    return layer, w8a8.ActivationQuantMethod(layer, TOKEN, dense_product, [(0, n, 0)], None, None, int_mm)


LAYOUTS = [(4, 32, "w4a8_vnni"), (4, 1 << 20, "w4a8_vnni"), (8, 1 << 20, "int8_vnni"),
           (4, 64, "w4a8_int_mm"), (8, 1 << 20, "int_mm")]


@pytest.mark.parametrize("bits, group, kernel", LAYOUTS)
def test_one_experts_product_is_the_dense_kernels(monkeypatch, bits, group, kernel):
    """Each expert's product (gate_up and down, 1 and 5 rows) bit-equal to the dense layer's method on the same
    weight (its kernel as KUBEINFER_W8A8_KERNEL chooses it); group 1 << 20: one scale a row."""
    if "int_mm" in kernel:
        monkeypatch.setenv("KUBEINFER_W8A8_KERNEL", "int_mm")
    weights = int_stacks(bits, group)
    assert choose_expert_kernel(expert(weights["gate_up"], 0), CPU, torch.float32, True, TOKEN) == kernel
    moe = kept_layer(weights, kernel)
    g = torch.Generator().manual_seed(1)
    for which, w in weights.items():
        n, k = w.values.shape[1:]
        for e in (0, 3):
            layer, method = dense_method(expert(w, e), kernel)
            assert method.kernel == kernel
            for m in (1, 5):
                x = torch.randn(m, k, generator=g)
                out = torch.full((m, n), float("nan"))
                moe.int_method.product(moe, which, e, x, out, None)
                assert torch.equal(out, method.apply(layer, x)), (which, e, m)


@pytest.mark.parametrize("bits, group, kernel", [(4, 32, "w4a8_vnni"), (8, 1 << 20, "int8_vnni")])
def test_the_kernel_is_looked_up_at_each_product_and_both_builds_agree(monkeypatch, bits, group, kernel):
    """ops.kernel asked at every native product (a reloaded library is the one called), and the layer's output
    the same bits under the AVX-512 build and its portable twin."""
    moe = kept_layer(int_stacks(bits, group, experts=8), kernel)
    g = torch.Generator().manual_seed(4)
    x, ids = torch.randn(6, 256, generator=g), torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(6)])
    weights = torch.softmax(torch.randn(6, 2, generator=g), -1)
    asked, lookup = [], ops.kernel
    monkeypatch.setattr(ops, "kernel", lambda name, *a: asked.append(name) or lookup(name, *a))
    moe(x, weights, ids)
    products = 2 * len(set(ids.flatten().tolist()))
    wanted = "ki_w4a8_f32" if bits == 4 else "ki_w8a8"
    assert asked.count(wanted) == products
    native, portable = outputs_of_both_builds(monkeypatch, lambda: moe(x, weights, ids))
    assert torch.equal(native, portable)


@pytest.mark.parametrize("bits, group, kernel", [(4, 32, "w4a8_vnni"), (8, 1 << 20, "int8_vnni"),
                                                 (4, 128, "w4a8_int_mm")])
def test_a8_experts_are_batch_invariant(monkeypatch, bits, group, kernel):
    """A token's output of the layer is the same bits alone as in a batch of 16 (whatever experts the others pick)."""
    assert_batch_invariant(kept_layer(int_stacks(bits, group, experts=8), kernel), experts=8)


ASYM_TOKEN = ActivationScheme("int", "token", True, False)
STATIC = ActivationScheme("int", "tensor", False, True)


@pytest.mark.parametrize("env, bits, inputs, expected", [
    ({}, 4, TOKEN, "w4a8_vnni"),
    ({}, 8, TOKEN, "int8_vnni"),
    ({"KUBEINFER_W8A8_KERNEL": "int_mm"}, 4, TOKEN, "w4a8_int_mm"),
    ({"KUBEINFER_W8A8_KERNEL": "int_mm"}, 8, TOKEN, "int_mm"),
    ({"KUBEINFER_W8A8_KERNEL": "fake_quant"}, 4, TOKEN, "dequantized"),  # as before: float stacks, inputs
    ({"KUBEINFER_W8A8_KERNEL": "fake_quant"}, 8, TOKEN, "dequantized"),  # fake-quantized
    ({"KUBEINFER_QUANT_KERNEL": "dequantized"}, 4, TOKEN, "dequantized"),
    ({"KUBEINFER_QUANT_KERNEL": "cpu_int4_vnni"}, 4, TOKEN, "w4a8_vnni"),  # a native CPU kernel: as dense W4A8
    ({"KUBEINFER_QUANT_KERNEL": "cpu_int4_bf16"}, 4, TOKEN, "cpu_int4_bf16"),  # torch's, forced: as before
    ({}, 4, ASYM_TOKEN, "dequantized"),  # activation schemes the products do not take: as before
    ({}, 8, STATIC, "dequantized"),
])
def test_the_kernel_switches_are_honoured_for_experts(monkeypatch, env, bits, inputs, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    sample = expert(int_stacks(bits, 32 if bits == 4 else 1 << 20, experts=1)["gate_up"], 0)
    assert choose_expert_kernel(sample, CPU, torch.float32, True, inputs) == expected


def test_weights_the_products_do_not_take_run_as_before():
    """Asymmetric int4, grouped int8, a bf16 model, no activation scheme (weight-only): not these products."""
    asym = expert(stacks(4, 32, True, experts=1)["gate_up"], 0)
    grouped = expert(int_stacks(8, 32, experts=1)["gate_up"], 0)
    int4 = expert(int_stacks(4, 32, experts=1)["gate_up"], 0)
    assert a8_experts.choose(asym, TOKEN, CPU, torch.float32) is None
    assert a8_experts.choose(grouped, TOKEN, CPU, torch.float32) is None
    assert a8_experts.choose(int4, TOKEN, CPU, torch.bfloat16) is None
    assert choose_expert_kernel(int4, CPU, torch.float32, False, None) == "cpu_int4_a16" or not ops.has_vnni()


def test_a_ranks_slice_quantizes_with_the_whole_rows_range():
    """Tensor parallel, 2 ranks: each holds half of down's input columns (groups of 128 cut to 64, IntWeight.narrow
    regroups them), and quantizes its slice of each (token, expert) row with the whole row's range (the layer's
    down range; here the other rank's slice, not an all-reduce). Each rank's product is bit-equal to the dense
    kernel on the whole row's int8 values cut to its columns, and the two partial sums add up to the one-rank
    product within float32 rounding."""
    from kubeinfer.engine.model_executor.layers.quantization.expert_input_quant import ExpertInputQuant
    from kubeinfer.engine.platforms.cpu.native import w4a8_ops

    full = int_stacks(4, 128, experts=2, hidden=128, inter=128)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    whole = kept_layer(full, "w4a8_vnni")
    one = torch.empty(3, 128)
    whole.int_method.product(whole, "down", 1, x, one, None)
    q, sx = w4a8_ops.quantized_tokens(x, TOKEN)
    partial = []
    for rank, cols in enumerate((slice(0, 64), slice(64, 128))):
        other = x[:, 64:] if rank == 0 else x[:, :64]
        sliced = {"gate_up": _narrowed(full["gate_up"], 0, slice(0, 128)), "down": _narrowed(full["down"], 1, cols)}
        assert sliced["down"].group_size == 64 and sliced["down"].values.shape == (2, 128, 64)
        moe = kept_layer(sliced, "w4a8_vnni")
        moe.input_quant = ExpertInputQuant(TOKEN, TOKEN, {}, down_range=lambda lo, hi, o=other: (
            torch.minimum(lo, o.amin(-1, keepdim=True).clamp(max=0)), torch.maximum(hi, o.amax(-1, keepdim=True))))
        out = torch.empty(3, 128)
        moe.int_method.product(moe, "down", 1, x[:, cols], out, None)
        narrowed = expert(sliced["down"], 1)
        layer, method = dense_method(narrowed, "w4a8_vnni")
        expected = w4a8_ops.product(q[:, cols].contiguous(), sx, layer.qweight_int4, layer.weight_group_scale, 64, 128)
        assert torch.equal(out, expected), rank
        partial.append(out)
    assert torch.allclose(partial[0] + partial[1], one, rtol=1e-5, atol=1e-5)


def _narrowed(weight, dim: int, part: slice):
    """Every expert's IntWeight cut to rows (dim 0) or input columns (1) `part` (IntWeight.narrow, restacked)."""
    from kubeinfer.engine.model_executor.layers.fused_moe.int_experts import stack

    return stack([expert(weight, e).narrow(dim, part.start, part.stop - part.start)
                  for e in range(weight.values.shape[0])])


@pytest.mark.slow  # two ranks' processes
def test_w4a8_moe_over_two_ranks_equals_the_reference(float_dirs, tmp_path):
    """tensor_parallel_size 2: each rank's experts hold their slices packed (gate/up rows, down's 32 of 64 input
    columns, one group of 32), each rank quantizing its slice of every (token, expert) intermediate row with the
    whole row's range (one all-reduce per active expert). Greedy tokens the reference's and the one-rank engine's,
    near ties excused (the ranks' partial sums add in another order)."""
    from test_quantized_w8a8_tp import rank_model

    from kubeinfer.engine.model_executor.layers.quantization.w8a8_tp import whole_token_range

    model_dir = w4a8_moe_checkpoint(float_dirs("qwen3_moe"), tmp_path / "w4a8", 32)
    for rank in (0, 1):
        model = rank_model(model_dir, rank, 2)
        assert set(model.expert_kernels.values()) == {"w4a8_vnni"}
        moe = next(iter(model.experts_modules().values()))
        assert moe.int_method.a8.layout["down"][3:] == (32, 1, 32)  # inputs, groups, group size
        assert moe.input_quant.ranges["down"] is whole_token_range
    reference = w4a8_moe_reference(model_dir)
    two = engine_greedy(model_dir, tensor_parallel_size=2)
    assert_greedy_equal_but_near_ties(two, hf_greedy(reference), reference, tie=GAPS[32][0])
    assert_greedy_equal_but_near_ties(two, engine_greedy(model_dir), reference, tie=GAPS[32][0])
