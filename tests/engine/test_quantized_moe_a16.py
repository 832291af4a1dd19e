"""MoE experts kept int4 / int8 through the exact A16 product (layers/fused_moe/a16_experts.py): the float32 CPU
default where the native library builds with AVX-512 BF16, as for the dense layers (platforms/cpu/native/a16_method.py).

References nobody here wrote: transformers on the checkpoint the `compressed-tensors` package wrote, decompressed
by it (`CompressedTensorsConfig(run_compressed=False)`; for asymmetric experts, which transformers cannot load, the
package's own decompression loaded as a float model), made the formats' A16 definition: the input of every
quantized product (attention projections and each expert's two products, in transformers' own expert loop)
rounded to bf16 by torch, the products in float32. The dense A16 kernel (tested against float64 and transformers
in test_quantized_kept.py / test_cpu_native_a16*.py) is the reference of one expert's product, bit for bit."""
import pytest
import test_quantized_moe
import torch
from quant_checkpoints import ct_compress, ct_scheme, float_weights, hf_compressed_tensors, hf_greedy, write_checkpoint
from test_quantized_moe import ROUTERS, eager, hf_float, package_decompressed
from test_quantized_moe_kept import engine, greedy
from torch import nn

from kubeinfer.engine.model_executor.layers.fused_moe.int_experts import ExpertsIntMethod, choose_expert_kernel
from kubeinfer.engine.model_executor.layers.fused_moe.layer import FusedMoE
from kubeinfer.engine.platforms.cpu.native import a16_method
from kubeinfer.engine.model_executor.layers.quantization.linear_method import IntWeight

pytestmark = pytest.mark.skipif(not a16_method.fast(), reason="the native library has no AVX-512 BF16 build here")
float_dirs = test_quantized_moe.float_dirs  # the same random models (module-scoped fixture)
CPU = torch.device("cpu")
# name: (bits, strategy, symmetric, group); int8 asymmetric or grouped experts were dequantized before A16
SCHEMES = {"w4a16_group_sym": (4, "group", True, 32), "w8a16_channel_sym": (8, "channel", True, None),
           "w8a16_channel_asym": (8, "channel", False, None), "w8a16_group_asym": (8, "group", False, 32)}


def a16_reference(hf):
    """transformers' model with every quantized product's input rounded to bf16 (torch's rounding): the attention
    projections by a pre-hook (the router is no nn.Linear: left float, as the checkpoint leaves it), the experts'
    products by rounding each F.linear input inside transformers' own eager expert loop."""
    for name, module in hf.named_modules():
        if isinstance(module, nn.Linear) and ".layers." in name:
            module.register_forward_pre_hook(lambda _, args: (args[0].to(torch.bfloat16).to(args[0].dtype),))
        if name.endswith("mlp.experts"):
            module.forward = _rounding_linear_inputs(module.forward)
    return hf


def _rounding_linear_inputs(forward):
    def run(*args, **kwargs):
        linear = nn.functional.linear
        nn.functional.linear = lambda x, w, b=None: linear(x.to(torch.bfloat16).to(x.dtype), w, b)
        try:
            return forward(*args, **kwargs)
        finally:
            nn.functional.linear = linear
    return run


def assert_a16_kept(llm, kernel: str, scheme: tuple) -> None:
    """Every layer's experts held as the A16 layout's bytes and nothing else (no float stack): per expert and
    projection [N, K], N padded to 16 rows: K * bits / 8 bytes a row, and per row and group a float32 scale and
    the zero points (int4: 2 int16, int8: 2 int32); the start-up log's weight bytes are the parameters'."""
    from kubeinfer.engine.core.model_setup import memory_summary

    bits, _, _, group = scheme
    model = llm.engine.runner.model
    assert set(model.expert_kernels.values()) == {kernel}
    for moe in model.experts_modules().values():
        expected = 0
        for which in ("gate_up", "down"):
            stack = getattr(moe, f"{which}_proj")
            assert stack.device.type == "meta"  # no float copy
            e, n, k = stack.shape
            rows, groups = -(-n // 16) * 16, 1 if group is None else k // group
            expected += e * rows * (k * bits // 8 + groups * (4 + (4 if bits == 4 else 8)))
        held = [p for p in moe.parameters() if p.device.type != "meta"]
        assert sum(p.numel() * p.element_size() for p in held) == expected
        assert not any(p.is_floating_point() and p.dim() == 3 and p.shape[1:] == moe.gate_up_proj.shape[1:]
                       for p in held)
    summary = memory_summary(llm.engine.runner, llm.engine.num_kv_blocks)
    held = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
    assert f"weights {held / (1 << 20):.2f} MiB" in summary and f"MoE expert layers {kernel}" in summary


@pytest.mark.parametrize("name, kernel", [
    ("w4a16_group_sym", "cpu_int4_a16"),
    pytest.param("w8a16_channel_sym", "cpu_int8_a16", marks=pytest.mark.slow),
    ("w8a16_group_asym", "cpu_int8_a16"),
    pytest.param("w8a16_channel_asym", "cpu_int8_a16", marks=pytest.mark.slow),
])
def test_default_a16_experts_give_transformers_tokens_with_bf16_inputs(float_dirs, tmp_path, monkeypatch, name,
                                                                        kernel):
    """The float32 default keeps every layer's experts (and the dense layers) through the A16 product, holding
    the packed integers (bytes checked), and its greedy tokens are the A16 reference's."""
    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    float_dir = float_dirs("qwen3_moe")
    bits, strategy, symmetric, group = SCHEMES[name]
    config = ct_scheme("pack-quantized", bits, "int", strategy, symmetric, group, ignore=ROUTERS["qwen3_moe"])
    model_dir = write_checkpoint(float_dir, tmp_path / "ct", ct_compress(float_weights(float_dir), config), config)
    llm = engine(model_dir)
    model = llm.engine.runner.model
    assert_a16_kept(llm, kernel, SCHEMES[name])
    assert set(model.quant_kernels.values()) == {kernel}
    tokens = greedy(llm)
    if symmetric:
        reference = eager(hf_compressed_tensors(model_dir, weight_only=True))
    else:  # transformers cannot load asymmetric experts: the package's decompression, as a float model
        reference = hf_float(write_checkpoint(float_dir, tmp_path / "dense", package_decompressed(model_dir), None))
    assert tokens == hf_greedy(a16_reference(reference))


def stacks(bits: int, group: int, asym: bool, experts=4, hidden=256, inter=128, seed=0) -> dict[str, IntWeight]:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-8, 7) if bits == 4 else (-128, 127)

    def weight(n, k):
        groups = k // min(group, k)
        zero = torch.randint(lo, hi + 1, (experts, n, groups), generator=g, dtype=torch.int8) if asym else None
        return IntWeight(torch.randint(lo, hi + 1, (experts, n, k), generator=g, dtype=torch.int8),
                         torch.rand(experts, n, groups, generator=g) * 0.01 + 1e-3, zero, min(group, k), bits)
    return {"gate_up": weight(2 * inter, hidden), "down": weight(hidden, inter)}


def expert(w: IntWeight, e: int) -> IntWeight:
    return IntWeight(w.values[e], w.scale[e], None if w.zero is None else w.zero[e], w.group_size, w.bits)


def kept_layer(weights: dict[str, IntWeight]) -> tuple[FusedMoE, str]:
    """A FusedMoE holding `weights` through the kernel the CPU's float32 default chooses for them."""
    moe = FusedMoE(weights["gate_up"].values.shape[0], weights["down"].values.shape[1],
                   weights["down"].values.shape[2])
    kernel = choose_expert_kernel(expert(weights["gate_up"], 0), CPU, torch.float32, False)
    moe.int_method = ExpertsIntMethod(moe, weights, kernel, torch.float32)
    return moe, kernel


LAYOUTS = [(4, 32, False), (4, 64, True), (4, 1 << 20, False), (8, 1 << 20, False), (8, 32, True), (8, 128, False)]


@pytest.mark.parametrize("bits, group, asym", LAYOUTS)
def test_one_experts_product_is_the_dense_a16_kernels(monkeypatch, bits, group, asym):
    """Each expert's product (gate_up and down, 1 and 5 rows) bit-equal to the dense layer's A16 method (the
    dense default) on the same weight; group 1 << 20: one scale a row."""
    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    weights = stacks(bits, group, asym)
    moe, kernel = kept_layer(weights)
    assert kernel == f"cpu_int{bits}_a16"
    g = torch.Generator().manual_seed(1)
    for which, w in weights.items():
        n, k = w.values.shape[1:]
        for e in (0, 3):
            dense = nn.Linear(k, n, bias=False)
            method = a16_method.A16Method(dense, expert(w, e), kernel, torch.float32)
            for m in (1, 5):
                x = torch.randn(m, k, generator=g)
                out = torch.full((m, n), float("nan"))
                moe.int_method.product(moe, which, e, x, out, None)
                assert torch.equal(out, method.apply(dense, x)), (which, e, m)


@pytest.mark.parametrize("bits, group, asym", [(4, 32, True), (8, 1 << 20, False)])
def test_a16_experts_are_batch_invariant(monkeypatch, bits, group, asym):
    """A token's output of the layer is the same bits alone as in a batch of 16 (whatever experts the others pick)."""
    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    moe, kernel = kept_layer(stacks(bits, group, asym, experts=8))
    assert kernel == f"cpu_int{bits}_a16"
    assert_batch_invariant(moe, experts=8)


def assert_batch_invariant(moe, experts: int) -> None:
    """Each of 16 tokens (hidden 256, top 2 of `experts`) gets the same bits from the layer alone as in the batch."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 256, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(16)])
    weights = torch.softmax(torch.randn(16, 2, generator=g), -1)
    batch = moe(x, weights, ids)
    for t in range(16):
        assert torch.equal(moe(x[t:t + 1], weights[t:t + 1], ids[t:t + 1])[0], batch[t]), t


@pytest.mark.parametrize("forced, bits, asym, expected", [
    (None, 8, True, "cpu_int8_a16"),  # asymmetric int8: kept (dequantized before A16)
    ("cpu_int4_a16", 8, False, "cpu_int8_a16"),  # the forced arithmetic, at the weight's width (dense: the same)
    ("cpu_int8_bf16", 8, False, "cpu_int8_bf16"),  # torch's products stay forcible
    ("cpu_int8_bf16", 8, True, "dequantized"),  # which do not take asymmetric int8: refused, as for dense layers
    ("cpu_int4_vnni", 4, False, "cpu_int4_bf16"),  # llama.cpp's arithmetic serves dense layers only
    ("dequantized", 4, False, "dequantized"),
])
def test_forced_kernels_are_honoured_for_experts(monkeypatch, forced, bits, asym, expected):
    if forced is None:
        monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    else:
        monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", forced)
    sample = expert(stacks(bits, 32 if bits == 4 else 1 << 20, asym, experts=1)["gate_up"], 0)
    assert choose_expert_kernel(sample, CPU, torch.float32, False) == expected


def test_a_ranks_regrouped_slice_multiplies_as_its_dequantized_weight(monkeypatch):
    """Tensor parallel rank 1 of 2: down's groups of 128 cut in two (IntWeight.narrow regroups to 64): the A16
    experts' product equals float64 on the slice's dequantized weight and bf16-rounded inputs (within float32
    sums' rounding) and the dense A16 kernel's bits."""
    from kubeinfer.engine.model_executor.expert_int_weights import _rank_slices

    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    full = stacks(4, 128, True, experts=2, hidden=128, inter=128)
    weights = {(p, e): expert(full["gate_up"], e).narrow(0, 0 if p == "gate_proj" else 128, 128)
               for p in ("gate_proj", "up_proj") for e in range(2)}
    weights.update({("down_proj", e): expert(full["down"], e) for e in range(2)})
    sliced = _rank_slices(FusedMoE(2, 128, 128, tp_rank=1, tp_size=2), weights)
    from kubeinfer.engine.model_executor.layers.fused_moe.int_experts import stack

    kept = {which: stack(parts) for which, parts in sliced.items()}
    assert kept["down"].group_size == 64 and kept["down"].values.shape == (2, 128, 64)
    moe, kernel = kept_layer(kept)
    assert kernel == "cpu_int4_a16"
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    for e in range(2):
        out = torch.empty(3, 128)
        moe.int_method.product(moe, "down", e, x, out, None)
        reference = x.to(torch.bfloat16).double() @ expert(kept["down"], e).dequantize().double().T
        assert torch.allclose(out.double(), reference, rtol=1e-5, atol=1e-6)
        dense = nn.Linear(64, 128, bias=False)
        method = a16_method.A16Method(dense, expert(kept["down"], e), kernel, torch.float32)
        assert torch.equal(out, method.apply(dense, x))
