"""`--quantization fp8` on a float MoE checkpoint keeps its experts in fp8 where a kept fp8 expert kernel exists
(model_executor/expert_int_weights.py, layers/fused_moe/int_experts.py): each expert's float weight quantized
per output row to e4m3 as it is read and stacked per layer, the float stacks never allocated. On CUDA that is
the fused Triton MoE kernel; here the kernel is forced (KUBEINFER_QUANT_KERNEL=triton) and runs in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1). The CPU default has no fp8 expert kernel: the experts
are round-tripped (quantized and dequantized back) into float stacks, as before, and the start-up log says so.

The reference is that round-trip path (what the engine ran before, itself held to transformers' FP8
quantizer and FineGrainedFP8Config in test_quantized_moe.py / test_quantized_moe_w8a8.py): the kept e4m3 bits
and scales are transformers' `Fp8Quantize` per-row ones bit for bit, dequantized they are the round trip's float
stacks bit for bit, the layer's outputs agree within float32 rounding (bound below), and greedy tokens are equal.
Before this change the forced kernel still round-tripped the experts into float stacks (and Qwen2-MoE's shared
expert gate/up): the layout, bits, bytes and shared-expert tests fail there on their kept assertions; the
greedy-token tests (regression guards: both paths gave the round trip's tokens) fail only on the start-up log
line, which named no round trip."""
import logging
from types import SimpleNamespace

import pytest
import test_quantized_moe
import torch
from load_peak import LiveBytes, held_bytes
from quant_checkpoints import MAX_TOKENS, PROMPTS, float_weights, triton_on_cpu

from kubeinfer.engine import LLM, SamplingParams

float_dirs = test_quantized_moe.float_dirs  # the same random models (module-scoped fixture)
expert_keys = test_quantized_moe.expert_keys
# the kept layer's output against the round trip's: the same float32 weights and e4m3-quantized inputs, the
# products summed in another order (measured 2.7e-7 to 3.7e-7 of the output's largest magnitude)
OUTPUT_RTOL = 1e-5


def load(model_dir, kernel: str | None, monkeypatch, **kwargs) -> LLM:
    if kernel is None:
        monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)  # the CPU's own choice
    else:
        monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", kernel)
    return LLM(model_dir, max_model_len=128, num_kv_blocks=64, quantization="fp8", **kwargs)


def greedy(llm) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def transformers_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' FP8 quantizer with one block per row ([1, columns]): e4m3 values and scale [rows, 1]."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(weight_block_size=[1, weight.shape[1]])
    pair = Fp8Quantize(SimpleNamespace(quantization_config=config)).convert({"w.weight": weight})
    return pair["w.weight"], pair["w.weight_scale_inv"]


def kept_dequantized(moe, which: str) -> torch.Tensor:
    values = getattr(moe, f"{which}_qweight").view(torch.float8_e4m3fn).to(torch.float32)
    return values * getattr(moe, f"{which}_scale")  # one scale per expert and row


def engines(float_dir, monkeypatch, caplog) -> tuple[LLM, LLM]:
    """(the round trip: the CPU default, the kept experts: the forced kernel)."""
    with caplog.at_level(logging.INFO, logger="kubeinfer.engine.model_executor.model_loader"):
        reference = load(float_dir, None, monkeypatch)
    assert "quantized to fp8 at load and dequantized back" in caplog.text
    return reference, load(float_dir, "triton", monkeypatch)


@triton_on_cpu
@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_kept_fp8_experts_are_the_round_trips_quantization(float_dirs, monkeypatch, caplog, family):
    float_dir = str(float_dirs(family))
    reference, kept = engines(float_dir, monkeypatch, caplog)
    ref_model, model = reference.engine.runner.model, kept.engine.runner.model
    assert not getattr(ref_model, "expert_kernels", None)
    assert model.expert_kernels == {name: "triton_fp8" for name in model.experts_modules()}
    from kubeinfer.engine.core.model_setup import memory_summary

    summary = memory_summary(kept.engine.runner, kept.engine.num_kv_blocks)  # the start-up log's line
    held = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
    assert f"weights {held / (1 << 20):.2f} MiB" in summary and "2 MoE expert layers triton_fp8" in summary
    weights = float_weights(float_dir)
    for i, (mine, theirs) in enumerate(zip(model.model.layers, ref_model.model.layers)):
        moe, ref = mine.mlp.experts, theirs.mlp.experts
        assert moe.gate_up_proj.device.type == "meta" and moe.down_proj.device.type == "meta"  # never allocated
        assert ref.gate_up_proj.device.type == "cpu"
        assert moe.gate_up_qweight.dtype == torch.uint8 and moe.input_quant is not None
        for e in range(moe.num_experts):
            gate, up, down = (transformers_per_row(weights[k]) for k in expert_keys(family, i, e))
            assert torch.equal(moe.gate_up_qweight[e], torch.cat([gate[0], up[0]]).view(torch.uint8))
            assert torch.equal(moe.down_qweight[e], down[0].view(torch.uint8))
            assert torch.equal(moe.gate_up_scale[e], torch.cat([gate[1], up[1]]))
            assert torch.equal(moe.down_scale[e], down[1])
        assert torch.equal(kept_dequantized(moe, "gate_up"), ref.gate_up_proj)
        assert torch.equal(kept_dequantized(moe, "down"), ref.down_proj)
        # the layer itself: the fused kernel on the e4m3 bits against the round trip's float stacks (CPU path)
        x = torch.randn(6, moe.hidden_size, generator=torch.Generator().manual_seed(i))
        weights_k, ids = torch.softmax(torch.randn(6, moe.num_experts), -1).topk(2)
        with torch.no_grad():
            out, expected = moe(x, weights_k, ids), ref(x, weights_k, ids)
        assert (out - expected).abs().max() <= OUTPUT_RTOL * expected.abs().max()


@triton_on_cpu
@pytest.mark.slow  # the whole engine under Triton's interpreter: 15-30 s
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_kept_fp8_experts_keep_the_round_trips_greedy_tokens(float_dirs, monkeypatch, caplog, family):
    reference, kept = engines(str(float_dirs(family)), monkeypatch, caplog)
    assert greedy(kept) == greedy(reference)


def test_a_ranks_kept_experts_are_its_slice_of_the_whole(float_dirs, monkeypatch):
    """Tensor parallelism, as the checkpoint path slices: each expert quantized per whole row first, then cut
    (gate/up: the rank's rows with their scales; down: its columns, with the whole row's scale), so each rank's
    bits are the one-rank model's, cut."""
    from kubeinfer.engine.model_executor.layers.attention_selector import get_attention_backend
    from kubeinfer.engine.model_executor.model_loader import inspect_model_dir, load_model

    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "triton")  # the loaded layout only: nothing is multiplied
    files = inspect_model_dir(float_dirs("qwen3_moe"), "fp8")

    def experts(rank, size):
        model = load_model(files, get_attention_backend("torch"), 64, torch.device("cpu"), torch.float32, rank, size)
        assert set(model.expert_kernels.values()) == {"triton_fp8"}
        return model.model.layers[1].mlp.experts
    whole = experts(0, 1)
    inter = whole.intermediate_size // 2
    for rank in (0, 1):
        moe = experts(rank, 2)
        assert moe.gate_up_proj.device.type == "meta"
        rows = torch.cat([torch.arange(rank * inter, (rank + 1) * inter),
                          whole.intermediate_size + torch.arange(rank * inter, (rank + 1) * inter)])
        assert torch.equal(moe.gate_up_qweight, whole.gate_up_qweight[:, rows])
        assert torch.equal(moe.gate_up_scale, whole.gate_up_scale[:, rows])
        assert torch.equal(moe.down_qweight, whole.down_qweight[..., rank * inter:(rank + 1) * inter])
        assert torch.equal(moe.down_scale.expand_as(whole.down_scale), whole.down_scale)  # the whole row's


# experts that dwarf the rest: 2 layers x 8 experts x 3 x 128 x 256 float32 = 6.3 MB; attention 0.4 MB
MEMORY_SHAPE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=256, num_experts=8,
                    num_heads=4, num_kv_heads=2, num_layers=2, vocab_size=256)


@triton_on_cpu
def test_kept_bytes_are_a_quarter_of_the_float_stacks_and_never_float_at_load(tmp_path, monkeypatch):
    """The experts hold one byte a weight and one float32 scale a row (0.257x the float32 stacks here), and the
    load never allocates their float stacks: its peak over the held bytes (tests/load_peak.py) is one layer's
    e4m3 experts in transit (per expert, then stacked: measured 0.33 of one layer's float stacks, 0.46 before
    the per-expert parts were let go as they were stacked; bound 0.45),
    where the round trip's load holds every float stack (measured peak 1.17-1.28x their bytes)."""
    from kubeinfer.dev.testing.random_model import build_random_model

    model_dir = str(build_random_model(tmp_path / "float", "qwen3_moe", tokenizer=False, seed=7, **MEMORY_SHAPE))

    def measured(kernel):
        with LiveBytes() as live:
            model = load(model_dir, kernel, monkeypatch).engine.runner.model
        experts = model.experts_modules().values()
        floats = sum(4 * (m.gate_up_proj.numel() + m.down_proj.numel()) for m in experts)
        held = sum(p.numel() * p.element_size() for m in experts for p in m.parameters() if p.device.type != "meta")
        return model, live.peak, held, floats

    model, peak, held, floats = measured("triton")
    e, h, i = MEMORY_SHAPE["num_experts"], MEMORY_SHAPE["hidden_size"], MEMORY_SHAPE["moe_intermediate_size"]
    per_layer = e * (2 * i * h + h * i) + 4 * e * (2 * i + h)  # e4m3 values, float32 scales per row; nothing else
    assert held == MEMORY_SHAPE["num_layers"] * per_layer and held < 0.27 * floats
    layer = floats / MEMORY_SHAPE["num_layers"]
    assert peak - held_bytes(model) < 0.45 * layer, (peak, held_bytes(model), layer)
    _, round_trip_peak, round_trip_held, _ = measured("dequantized")
    assert round_trip_held == floats and round_trip_peak > floats


def test_qwen2_moe_shared_expert_is_kept_like_a_dense_projection(float_dirs, monkeypatch):
    """Qwen2-MoE's shared expert (gate/up fused here, its own intermediate size) is kept e4m3 per row like the
    dense projections (before: its gate/up round-tripped into float); the routers and shared-expert gate float."""
    from kubeinfer.engine.model_executor.layers.attention_selector import get_attention_backend
    from kubeinfer.engine.model_executor.model_loader import inspect_model_dir, load_model

    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "triton")  # the loaded layout only: nothing is multiplied
    float_dir = float_dirs("qwen2_moe")
    model = load_model(inspect_model_dir(float_dir, "fp8"), get_attention_backend("torch"), 64, torch.device("cpu"),
                       torch.float32)
    weights = float_weights(float_dir)
    assert set(model.expert_kernels.values()) == {"triton_fp8"}
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}.mlp"
        for part in ("gate_up_proj", "down_proj"):
            assert model.quant_kernels[f"{prefix}.shared_expert.{part}"] == "triton_fp8"
        shared = layer.mlp.shared_expert.gate_up_proj
        gate, up = (transformers_per_row(weights[f"{prefix}.shared_expert.{p}_proj.weight"]) for p in ("gate", "up"))
        assert shared.weight.device.type == "meta"
        assert torch.equal(shared.qweight, torch.cat([gate[0], up[0]]).view(torch.uint8))
        assert torch.equal(shared.weight_scale, torch.cat([gate[1], up[1]]))
        for router in (layer.mlp.gate, layer.mlp.shared_expert_gate):
            assert router.weight.dtype == torch.float32 and not hasattr(router, "qweight")


@triton_on_cpu
@pytest.mark.slow  # two ranks, each under Triton's interpreter
def test_two_ranks_of_kept_fp8_experts_give_one_ranks_tokens(float_dirs, monkeypatch):
    """Each rank multiplies its slice of the kept e4m3 experts (the down input's per-token scale over the whole
    row, all-reduced: w8a8_tp.whole_token_range): the tokens of one rank, and of the round trip. (It guards the
    kept path's numerics under TP, which the old code never took: each rank giving down its rank-0 columns fails
    it; the kept layout itself is test_a_ranks_kept_experts_are_its_slice_of_the_whole's.)"""
    from quant_checkpoints import engine_greedy

    float_dir = str(float_dirs("qwen3_moe"))
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "triton")
    kept = engine_greedy(float_dir, quantization="fp8", tensor_parallel_size=2)
    assert kept == engine_greedy(float_dir, quantization="fp8")
    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL")
    assert kept == engine_greedy(float_dir, quantization="fp8")
