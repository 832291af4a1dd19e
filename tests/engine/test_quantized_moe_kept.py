"""Quantized MoE experts kept quantized in memory (layers/fused_moe/int_experts.py): the stacked expert
parameters hold the checkpoint's integers (int8: one byte a weight; int4: half a byte, torch's CPU int4 pack
per expert) and the float stacks are shapes on the meta device. References nobody here wrote, as in
test_quantized_moe.py: transformers with `CompressedTensorsConfig(run_compressed=False)` (its experts
decompressed by the compressed-tensors package), or the package's own decompression loaded as a float model
(AWQ through its converter), GPTQ's float weights computed before packing.

With float32 activations (KUBEINFER_QUANT_KERNEL=cpu_int4 / cpu_int8 forces the kernels) torch's weight-only
products are exact enough that greedy tokens equal the reference's. The CPU default (bf16 activations, the
formats' "A16": the exact A16 product where the native library builds it, else torch's `*_bf16`) is held to
log-probabilities within a measured bound of the reference (test_quantized_moe_a16.py: the A16 experts' tokens)."""
import pytest
import test_quantized_moe
import torch
from quant_checkpoints import (
    MAX_TOKENS,
    PROMPTS,
    awq_pack,
    awq_to_compressed_tensors,
    ct_compress,
    ct_scheme,
    float_weights,
    gptq_pack,
    hf_compressed_tensors,
    hf_greedy,
    triton_on_cpu,
    write_checkpoint,
)
from test_quantized_moe import ct_checkpoint, eager, hf_float, package_decompressed

from kubeinfer.engine import LLM, SamplingParams

slow = pytest.mark.slow
float_dirs = test_quantized_moe.float_dirs  # the same random models (module-scoped fixture)


def engine(model_dir, **kwargs):
    return LLM(model_dir, max_model_len=128, num_kv_blocks=64, **kwargs)


def greedy(llm) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def expert_bytes(model) -> tuple[int, int]:
    """(bytes the experts' parameters hold, weights they stand for)."""
    held = weights = 0
    for name, moe in model.experts_modules().items():
        weights += moe.gate_up_proj.numel() + moe.down_proj.numel()
        held += sum(p.numel() * p.element_size() for p in moe.parameters() if p.device.type != "meta")
    return held, weights


def assert_kept(model, kernel: str, bytes_per_weight: float) -> None:
    assert set(model.expert_kernels.values()) == {kernel}
    for moe in model.experts_modules().values():
        assert moe.gate_up_proj.device.type == "meta" and moe.down_proj.device.type == "meta"  # no float copy
        assert not moe.gate_up_qweight.is_floating_point()
    held, weights = expert_bytes(model)
    # values at bytes_per_weight, plus the scales (and zeros): at most one 2-4 byte pair per 32 weights here
    assert bytes_per_weight * weights <= held <= (bytes_per_weight + 0.26) * weights, (held, weights)


@pytest.mark.parametrize("family, name, kernel, per_weight", [
    ("qwen3_moe", "w4a16_group_sym", "cpu_int4", 0.5),
    ("qwen3_moe", "w8a16_channel_sym", "cpu_int8", 1.0),
    pytest.param("mixtral", "w4a16_group_asym", "cpu_int4", 0.5, marks=slow),
    pytest.param("qwen2_moe", "w8a16_channel_sym", "cpu_int8", 1.0, marks=slow),
])
def test_kept_experts_give_transformers_decompressed_tokens(float_dirs, tmp_path, monkeypatch, family, name,
                                                            kernel, per_weight):
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", kernel)
    model_dir, _ = ct_checkpoint(float_dirs(family), name, tmp_path / "ct")
    llm = engine(model_dir)
    assert_kept(llm.engine.runner.model, kernel, per_weight)
    tokens = greedy(llm)
    if name.endswith("_sym"):
        reference = eager(hf_compressed_tensors(model_dir, weight_only=True))
    else:  # transformers cannot load asymmetric experts: the package's decompression, as a float model
        reference = hf_float(write_checkpoint(float_dirs(family), tmp_path / "dense", package_decompressed(model_dir),
                                              None))
    assert tokens == hf_greedy(reference)


@pytest.mark.parametrize("fmt", ["awq", pytest.param("gptq", marks=slow)])
def test_kept_awq_and_gptq_experts(float_dirs, tmp_path, monkeypatch, fmt):
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "cpu_int4")
    float_dir = float_dirs("mixtral")
    if fmt == "awq":
        weights, config = awq_pack(float_weights(float_dir))
        config["modules_to_not_convert"] = ["gate"]
        converted = write_checkpoint(float_dir, tmp_path / "awq_as_ct", *awq_to_compressed_tensors(weights, config))
        dense = package_decompressed(converted)
    else:
        weights, config, dense = gptq_pack(float_weights(float_dir), 4, 128, seed=4)
    model_dir = write_checkpoint(float_dir, tmp_path / fmt, weights, config)
    llm = engine(model_dir)
    assert_kept(llm.engine.runner.model, "cpu_int4", 0.5)
    assert greedy(llm) == hf_greedy(hf_float(write_checkpoint(float_dir, tmp_path / "dense", dense, None)))


@pytest.mark.parametrize("family", ["default", "bf16"])
def test_cpu_default_keeps_experts_with_bf16_activations_close_to_the_reference(float_dirs, tmp_path, monkeypatch,
                                                                                family):
    """The float32 default (the exact A16 product where the native library builds with AVX-512 BF16, else torch's
    `cpu_int4_bf16`, forced by `bf16`): every top-3 log-probability of the first token within 0.25 of
    transformers' float32 on the decompressed checkpoint over 8 prompts (the dense layers' bound,
    test_quantized_kept.py; measured 0.049 torch's, 0.032 A16 here; with the experts' int4 scales 10% off a
    greedy token differs), and the start-up log's weight bytes are the kept ones.
    Only the experts are quantized (`re:.*experts.*`): the dense layers' own bf16 kernel, whose rounding flips a
    near-tied router choice of this random model (a 2.5 log-prob jump on one prompt), is not what is measured."""
    from kubeinfer.engine.platforms.cpu.native import a16_method

    kernel = "cpu_int4_a16" if family == "default" and a16_method.fast() else "cpu_int4_bf16"
    if family == "bf16":
        monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", kernel)
    else:
        monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    float_dir = float_dirs("qwen3_moe")
    config = ct_scheme("pack-quantized", 4, "int", "group", True, 32)
    config["config_groups"]["group_0"]["targets"] = ["re:.*experts.*"]
    experts_only = lambda k: ".experts." in k and k.endswith(".weight")  # noqa: E731
    weights = ct_compress(float_weights(float_dir), config, select=experts_only)
    model_dir = write_checkpoint(float_dir, tmp_path / "ct", weights, config)
    llm = engine(model_dir)
    model = llm.engine.runner.model
    assert_kept(model, kernel, 0.5)
    from kubeinfer.engine.core.model_setup import memory_summary

    summary = memory_summary(llm.engine.runner, llm.engine.num_kv_blocks)
    held = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
    assert f"weights {held / (1 << 20):.2f} MiB" in summary and f"2 MoE expert layers {kernel}" in summary
    prompts = [list(range(3 + i, 40 + 3 * i)) for i in range(8)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=1, logprobs=3))
    reference = eager(hf_compressed_tensors(model_dir, weight_only=True))
    worst = 0.0
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            theirs = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, -1].float(), -1)
        for token, logprob in output.outputs[0].logprobs[0].items():
            worst = max(worst, abs(float(getattr(logprob, "logprob", logprob)) - float(theirs[token])))
        top2 = theirs.topk(2).values
        if float(top2[0] - top2[1]) > 0.25:
            assert output.outputs[0].token_ids[0] == int(theirs.argmax())
    assert worst < 0.25, worst
    assert not model.quant_kernels  # the dense layers stayed float


def test_dequantized_kernel_keeps_the_float_stacks(float_dirs, tmp_path, monkeypatch):
    """KUBEINFER_QUANT_KERNEL=dequantized: the experts dequantized at load into float stacks, as before."""
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "dequantized")
    model_dir, _ = ct_checkpoint(float_dirs("qwen3_moe"), "w4a16_group_sym", tmp_path / "ct")
    model = engine(model_dir).engine.runner.model
    assert not getattr(model, "expert_kernels", {})
    held, weights = expert_bytes(model)
    assert held == 4 * weights  # float32


@pytest.mark.parametrize("name", ["int8_dynamic", pytest.param("int8_static_asym", marks=slow)])
def test_kept_int8_experts_of_a_w8a8_checkpoint_quantize_their_inputs(float_dirs, tmp_path, monkeypatch, name):
    """W8A8 (int8 weights per channel, int8 activations): the experts' inputs quantized as before
    (expert_input_quant.py), then multiplied by the kept int8 weights (float32 activations: the forced cpu_int8),
    against
    test_quantized_moe_w8a8.py's reference (the package's decompression, every input fake-quantized by it)."""
    from quant_checkpoints import assert_greedy_equal_but_near_ties
    from test_quantized_moe_w8a8 import ct_moe_checkpoint, ct_moe_reference

    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "cpu_int8")
    float_dir = float_dirs("qwen3_moe")
    model_dir = ct_moe_checkpoint(float_dir, name, tmp_path / "ct")
    llm = engine(model_dir)
    model = llm.engine.runner.model
    assert_kept(model, "cpu_int8", 1.0)
    assert all(moe.input_quant is not None for moe in model.experts_modules().values())
    reference = ct_moe_reference(model_dir, float_dir, tmp_path / "dense")
    assert_greedy_equal_but_near_ties(greedy(llm), hf_greedy(reference), reference)


@triton_on_cpu
@slow
def test_kept_fp8_block_experts_through_the_fused_kernel(float_dirs, tmp_path, monkeypatch):
    """Qwen3-30B-A3B-FP8's format (block-wise e4m3 weights, dynamic activations): on CUDA the experts stay e4m3
    (one byte a weight) and the fused MoE kernel decodes them; here the kernel is forced and runs in Triton's
    interpreter. Greedy tokens: test_quantized_moe_w8a8.py's reference (transformers' FineGrainedFP8Config(
    dequantize=True), every input fake-quantized), near ties excused."""
    from quant_checkpoints import assert_greedy_equal_but_near_ties
    from test_quantized_moe_w8a8 import fp8_moe_checkpoint, fp8_moe_reference

    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "triton")
    model_dir = fp8_moe_checkpoint(float_dirs("qwen3_moe"), tmp_path / "fp8")
    llm = engine(model_dir)
    model = llm.engine.runner.model
    assert_kept(model, "triton_fp8", 1.0)
    assert next(iter(model.experts_modules().values())).gate_up_qweight.dtype == torch.uint8  # the e4m3 bits
    reference = fp8_moe_reference(model_dir)
    assert_greedy_equal_but_near_ties(greedy(llm), hf_greedy(reference), reference)


@slow
@pytest.mark.parametrize("kernel", ["cpu_int4", "cpu_int4_a16"])
def test_kept_experts_split_over_tensor_parallel_ranks(float_dirs, tmp_path, monkeypatch, kernel):
    """Each rank keeps its slice of every expert's integers: gate/up rows, down columns, the 128 down columns of
    a group of 128 cut in two and regrouped (IntWeight.narrow): the same tokens as one rank."""
    from quant_checkpoints import ct_compress, ct_scheme, engine_greedy

    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", kernel)
    float_dir = float_dirs("qwen3_moe")
    config = ct_scheme("pack-quantized", 4, "int", "group", False, 128, ignore=("re:.*mlp.gate$",))
    model_dir = write_checkpoint(float_dir, tmp_path / "ct", ct_compress(float_weights(float_dir), config), config)
    one = engine(model_dir)
    assert_kept(one.engine.runner.model, kernel, 0.5)
    expected = greedy(one)
    one.shutdown()
    assert engine_greedy(model_dir, tensor_parallel_size=2) == expected


def test_a_ranks_slice_of_each_expert_cuts_a_group_exactly():
    """Rank 1 of 2: gate/up rows 64-127 of each, down columns 64-127, inside down's groups of 128: regrouped to
    64 columns with their group's scale and zero, the same weights as the dequantized whole, cut."""
    from kubeinfer.engine.model_executor.expert_int_weights import _rank_slices
    from kubeinfer.engine.model_executor.layers.fused_moe.layer import FusedMoE
    from kubeinfer.engine.model_executor.layers.quantization.linear_method import IntWeight

    g = torch.Generator().manual_seed(1)

    def weight(rows, cols, group):
        return IntWeight(torch.randint(-8, 8, (rows, cols), generator=g, dtype=torch.int8),
                         torch.rand(rows, cols // group, generator=g), torch.randint(-8, 8, (rows, cols // group),
                         generator=g, dtype=torch.int8), group, 4)
    moe = FusedMoE(2, 64, 128, tp_rank=1, tp_size=2)
    weights = {(p, e): weight(128, 64, 32) for p in ("gate_proj", "up_proj") for e in range(2)}
    weights.update({("down_proj", e): weight(64, 128, 128) for e in range(2)})
    sliced = _rank_slices(moe, weights)
    for e in range(2):
        gate, up = (weights[(p, e)].dequantize()[64:] for p in ("gate_proj", "up_proj"))
        assert torch.equal(sliced["gate_up"][e].dequantize(), torch.cat([gate, up]))
        down = sliced["down"][e]
        assert down.group_size == 64 and torch.equal(down.dequantize(), weights[("down_proj", e)].dequantize()[:, 64:])


def test_experts_without_an_integer_form_are_dequantized_into_float_stacks(float_dirs, tmp_path, monkeypatch):
    """GPTQ act-order (each row's group from g_idx): no kept layout, so the float stacks, never allocated while
    the loader expected kept experts, are allocated by the first expert written into them."""
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "cpu_int4")
    float_dir = float_dirs("qwen3_moe")
    weights, config, dense = gptq_pack(float_weights(float_dir), 4, 32, act_order=True, seed=5)
    model_dir = write_checkpoint(float_dir, tmp_path / "gptq", weights, config)
    llm = engine(model_dir)
    model = llm.engine.runner.model
    assert not model.expert_kernels
    assert all(m.gate_up_proj.device.type == "cpu" and m.down_proj.device.type == "cpu"
               for m in model.experts_modules().values())
    assert greedy(llm) == hf_greedy(hf_float(write_checkpoint(float_dir, tmp_path / "dense", dense, None)))
