"""Quantized mixture-of-experts checkpoints (issue 29): Qwen3-MoE, Qwen2-MoE and Mixtral in compressed-tensors,
AWQ and GPTQ with their experts quantized (routers left float, as llm-compressor's `ignore` and AutoAWQ's
`modules_to_not_convert` leave them), served with each expert dequantized at load into the stacked float
experts; and `--quantization fp8` on a float MoE checkpoint, which round-trips the experts too.

References nobody here wrote, the same per format as the dense tests (test_quantized_int.py):
- compressed-tensors, symmetric: the checkpoint is written by the `compressed-tensors` package under the key
  names llm-compressor publishes (`model.layers.N.mlp.experts.E.gate_proj.weight_packed`, Mixtral's
  `block_sparse_moe.experts.E.w1.weight_packed`); transformers reads them with
  `CompressedTensorsConfig(run_compressed=False)` into its fused [E, 2I, H] experts. That transformers really
  dequantized the experts is checked: its stacked experts equal the package's own decompression
  (`CompressedTensorsDequantizer`) element for element, and differ from the float model's.
- compressed-tensors, asymmetric, and AWQ (through compressed-tensors' own AutoAWQ converter): transformers 5.24
  cannot load asymmetric experts (its expert decompression drops the zero points: "Asymmetric quant requires
  zero-point values"), so the reference is the package's own decompression of the whole checkpoint, loaded by
  transformers as a float model.
- GPTQ: transformers on the float weights (q - zero) * scale computed before packing (tests/quant_checkpoints.py).
- fp8 at load: transformers' own FP8 quantizer (`Fp8Quantize`, per channel) writes the experts, and
  `FineGrainedFP8Config(dequantize=True)` reads them.
One family per format runs in the default suite; the others are slow."""
import pytest
import torch
from quant_checkpoints import (
    MAX_TOKENS,
    PROMPTS,
    awq_pack,
    awq_to_compressed_tensors,
    ct_compress,
    ct_scheme,
    engine_greedy,
    float_weights,
    gptq_pack,
    hf_compressed_tensors,
    hf_greedy,
    is_decoder_linear,
    write_checkpoint,
)

from kubeinfer.engine import LLM, SamplingParams

# 128 input columns everywhere but Mixtral's and the shared expert's down_proj (256): groups of 128 fit.
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_heads": 4, "num_kv_heads": 2, "num_layers": 2}
FAMILIES = {"qwen3_moe": {"moe_intermediate_size": 128}, "mixtral": {},
            "qwen2_moe": {"moe_intermediate_size": 128, "shared_expert_intermediate_size": 256}}
# What llm-compressor's MoE recipes leave float: the routers (and Qwen2-MoE's shared-expert gate).
ROUTERS = {"qwen3_moe": ("re:.*mlp.gate$",), "mixtral": ("re:.*block_sparse_moe.gate$",),
           "qwen2_moe": ("re:.*mlp.gate$", "re:.*shared_expert_gate$")}
CT = {  # name: (bits, strategy, symmetric, group_size)
    "w4a16_group_sym": (4, "group", True, 32),
    "w8a16_channel_sym": (8, "channel", True, None),
    "w4a16_group_asym": (4, "group", False, 64),
    "w8a16_channel_asym": (8, "channel", False, None),
}
slow = pytest.mark.slow


@pytest.fixture(autouse=True)
def dequantized_kernel(monkeypatch):
    """The dense layers of these MoE models would take the CPU's kept-int kernels, which round float32
    activations to bf16 (test_quantized_kept.py bounds those): here the loader's weights are held to the
    references exactly, so they are dequantized, as the experts are."""
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "dequantized")


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    root, built = tmp_path_factory.mktemp("moe_quant"), {}

    def get(family: str):
        if family not in built:
            built[family] = build_random_model(root / family, family, tokenizer=False, seed=29,
                                               **SHAPE, **FAMILIES[family])
        return built[family]
    return get


def eager(model):
    """transformers' experts one at a time (the engine's grouped product is bit-equal to that order)."""
    model.set_experts_implementation("eager")
    return model


def hf_float(model_dir):
    from transformers import AutoModelForCausalLM

    return eager(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())


def ct_checkpoint(float_dir, name: str, dst) -> tuple[str, dict]:
    """The compressed-tensors checkpoint (written to `dst`) and its config."""
    bits, strategy, symmetric, group = CT[name]
    config = ct_scheme("pack-quantized", bits, "int", strategy, symmetric, group,
                       ignore=ROUTERS[float_dir.name])
    weights = ct_compress(float_weights(float_dir), config)
    return write_checkpoint(float_dir, dst, weights, config), config


def package_decompressed(model_dir) -> dict:
    """The whole checkpoint as the compressed-tensors package decompresses it (float32), no transformers."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    return CompressedTensorsDequantizer(model_dir, dtype=torch.float32).validate(float_weights(model_dir))


def expert_keys(family: str, layer: int, expert: int) -> tuple[str, str, str]:
    block, names = ("block_sparse_moe", ("w1", "w3", "w2")) if family == "mixtral" else \
        ("mlp", ("gate_proj", "up_proj", "down_proj"))
    return tuple(f"model.layers.{layer}.{block}.experts.{expert}.{n}.weight" for n in names)


def assert_experts_equal(model, family: str, weights: dict, rtol: float = 0.0) -> None:
    """The engine's stacked experts [E, 2I, H] / [E, H, I] equal per-expert checkpoint-named float weights."""
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for e in range(experts.num_experts):
            gate, up, down = (weights[k] for k in expert_keys(family, i, e))
            assert torch.allclose(experts.gate_up_proj[e], torch.cat([gate, up]), rtol=rtol, atol=0), (i, e)
            assert torch.allclose(experts.down_proj[e], down, rtol=rtol, atol=0), (i, e)


def engine_run(model_dir, **kwargs):
    """The engine's greedy tokens (tests/quant_checkpoints.py's prompts) and its model, from one engine."""
    llm = LLM(model_dir, max_model_len=128, num_kv_blocks=64, **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outputs], llm.engine.runner.model


@pytest.mark.parametrize("family, name", [
    ("qwen3_moe", "w4a16_group_sym"),  # what llm-compressor publishes for Qwen3-30B-A3B (W4A16, groups)
    pytest.param("mixtral", "w8a16_channel_sym", marks=slow),
    pytest.param("qwen2_moe", "w4a16_group_sym", marks=slow),
])
def test_compressed_tensors_moe_equals_transformers_decompressed(float_dirs, tmp_path, family, name):
    float_dir = float_dirs(family)
    model_dir, _ = ct_checkpoint(float_dir, name, tmp_path / "ct")
    keys = float_weights(model_dir)
    gate, _, down = expert_keys(family, 1, 3)
    assert f"{gate[:-len('weight')]}weight_packed" in keys and f"{down[:-len('weight')]}weight_scale" in keys
    assert not any(k.endswith(("gate.weight_packed", "gate.weight_scale")) for k in keys)  # routers stay float
    hf = eager(hf_compressed_tensors(model_dir, weight_only=True))
    reference = package_decompressed(model_dir)
    for i, theirs in enumerate(hf.model.layers):  # transformers' fused experts hold the dequantized weights
        g, u, d = (reference[k] for k in expert_keys(family, i, 3))
        assert torch.equal(theirs.mlp.experts.gate_up_proj[3], torch.cat([g, u]))
        assert torch.equal(theirs.mlp.experts.down_proj[3], d)
    assert not torch.equal(reference[down], float_weights(float_dir)[down])  # the experts really were quantized
    tokens, model = engine_run(model_dir)
    assert tokens == hf_greedy(hf)
    assert_experts_equal(model, family, reference)


@slow
def test_mixed_config_groups_give_the_experts_their_own_scheme(float_dirs, tmp_path):
    """int8 channel for every `Linear`, int4 groups for `re:.*experts.*`: the experts take the regex's group
    (the compressed-tensors package's precedence: name, regex, class), whatever the groups' order."""
    family = "qwen3_moe"
    float_dir = float_dirs(family)
    config = ct_scheme("pack-quantized", 8, "int", "channel", True, None, ignore=ROUTERS[family])
    experts = ct_scheme("pack-quantized", 4, "int", "group", True, 32)["config_groups"]["group_0"]
    config["config_groups"]["group_1"] = {**experts, "targets": ["re:.*experts.*"]}
    dense = ct_compress(float_weights(float_dir), config, select=lambda k: is_decoder_linear(k) and ".experts." not in k)
    weights = ct_compress(dense, config, "group_1", select=lambda k: ".experts." in k and k.endswith(".weight"))
    model_dir = write_checkpoint(float_dir, tmp_path / "mixed", weights, config)
    hf = eager(hf_compressed_tensors(model_dir, weight_only=True))
    tokens, model = engine_run(model_dir)
    assert tokens == hf_greedy(hf)
    for mine, theirs in zip(model.model.layers, hf.model.layers):
        assert torch.equal(mine.mlp.experts.gate_up_proj, theirs.mlp.experts.gate_up_proj)
        assert torch.equal(mine.mlp.experts.down_proj, theirs.mlp.experts.down_proj)
        assert torch.equal(mine.self_attn.o_proj.weight, theirs.self_attn.o_proj.weight)


@pytest.mark.parametrize("family, name", [
    pytest.param("qwen3_moe", "w4a16_group_asym", marks=slow),
    pytest.param("mixtral", "w4a16_group_asym", marks=slow),
    pytest.param("qwen2_moe", "w8a16_channel_asym", marks=slow),
])
def test_asymmetric_compressed_tensors_moe_equals_the_packages_decompression(float_dirs, tmp_path, family, name):
    float_dir = float_dirs(family)
    model_dir, _ = ct_checkpoint(float_dir, name, tmp_path / "ct")
    reference = package_decompressed(model_dir)
    tokens, model = engine_run(model_dir)
    assert tokens == hf_greedy(hf_float(write_checkpoint(float_dir, tmp_path / "dense", reference, None)))
    assert_experts_equal(model, family, reference)


@pytest.mark.parametrize("family", ["mixtral", pytest.param("qwen2_moe", marks=slow)])
def test_awq_moe_equals_compressed_tensors_conversion(float_dirs, tmp_path, family):
    """AutoAWQ's MoE checkpoints keep the router float (Mixtral's `modules_to_not_convert: ["gate"]`; the
    converter matches them as substrings, so Qwen's names the routers whole, not its experts' gate_proj). The
    reference dequantizes in the scales' float16, the engine in float32: weights equal within fp16's rounding."""
    float_dir = float_dirs(family)
    weights, config = awq_pack(float_weights(float_dir))
    config["modules_to_not_convert"] = ["gate"] if family == "mixtral" else ["mlp.gate", "shared_expert_gate"]
    awq_dir = write_checkpoint(float_dir, tmp_path / "awq", weights, config)
    converted, ct_config = awq_to_compressed_tensors(weights, config)
    ct_dir = write_checkpoint(float_dir, tmp_path / "awq_as_ct", converted, ct_config)
    reference = package_decompressed(ct_dir)
    tokens, model = engine_run(awq_dir)
    assert tokens == hf_greedy(hf_float(write_checkpoint(float_dir, tmp_path / "dense", reference, None)))
    assert_experts_equal(model, family, reference, rtol=2 ** -10)


@pytest.mark.parametrize("family, bits", [("qwen2_moe", 4), pytest.param("qwen3_moe", 8, marks=slow),
                                          pytest.param("mixtral", 4, marks=slow)])
def test_gptq_moe_equals_its_float_weights(float_dirs, tmp_path, family, bits):
    float_dir = float_dirs(family)
    weights, config, dense = gptq_pack(float_weights(float_dir), bits, 128, seed=bits)
    model_dir = write_checkpoint(float_dir, tmp_path / "gptq", weights, config)
    tokens, model = engine_run(model_dir)
    assert tokens == hf_greedy(hf_float(write_checkpoint(float_dir, tmp_path / "dense", dense, None)))
    assert_experts_equal(model, family, dense)


def test_fp8_flag_on_a_float_moe_checkpoint_quantizes_the_experts(tmp_path):
    """--quantization fp8 on float Qwen2-MoE: experts and shared expert per channel, bit for bit what
    transformers' FP8 quantizer writes ([1, 64] blocks: every input dimension is 64 here); routers float. The
    activations per token, the experts' too (vLLM's online fp8 is W8A8): test_quantized_moe_w8a8.py's reference."""
    from quant_checkpoints import assert_greedy_equal_but_near_ties
    from test_quantized_fp8 import fp8_config, fp8_quantize
    from test_quantized_moe_w8a8 import fp8_moe_reference

    from kubeinfer.dev.testing.random_model import build_random_model

    float_dir = build_random_model(tmp_path / "float", "qwen2_moe", tokenizer=False, seed=31, hidden_size=64,
                                   intermediate_size=64, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                   num_heads=4, num_kv_heads=2, num_layers=2)
    weights = float_weights(float_dir)
    reference = write_checkpoint(float_dir, tmp_path / "fp8", fp8_quantize(weights, [1, 64]), fp8_config([1, 64]))
    hf = fp8_moe_reference(reference)
    tokens, model = engine_run(str(float_dir), quantization="fp8")
    assert_greedy_equal_but_near_ties(tokens, hf_greedy(hf), hf)
    assert "fp8 e4m3 dynamic per token (fused experts)" in model.activation_schemes.values()
    assert not any(name.endswith(("mlp.gate", "shared_expert_gate")) for name in model.activation_schemes)
    for mine, theirs in zip(model.model.layers, hf.model.layers):
        assert torch.equal(mine.mlp.experts.gate_up_proj, theirs.mlp.experts.gate_up_proj)
        assert torch.equal(mine.mlp.experts.down_proj, theirs.mlp.experts.down_proj)
        shared = theirs.mlp.shared_expert
        assert torch.equal(mine.mlp.shared_expert.gate_up_proj.weight,
                           torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        assert torch.equal(mine.mlp.shared_expert.down_proj.weight, shared.down_proj.weight)
        assert torch.equal(mine.mlp.gate.weight, theirs.mlp.gate.weight)  # the routers stay float
        assert torch.equal(mine.mlp.shared_expert_gate.weight, theirs.mlp.shared_expert_gate.weight)
    down = "model.layers.0.mlp.experts.0.down_proj.weight"
    assert not torch.equal(model.model.layers[0].mlp.experts.down_proj[0], weights[down])


@slow
def test_fp8_flag_on_float_gpt_oss_quantizes_its_stacked_experts_per_output_channel(tmp_path):
    """gpt-oss's float experts are stacked [E, in, out] and interleaved in the checkpoint: the round trip applies
    in our [E, out, in] layout, each expert's rows as transformers' FP8 quantizer scales a [out, in] weight."""
    from types import SimpleNamespace

    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    from kubeinfer.dev.testing.random_model import build_random_model

    float_dir = build_random_model(tmp_path / "float", "gpt_oss", tokenizer=False, seed=3, hidden_size=64,
                                   intermediate_size=64, num_heads=4, num_kv_heads=2, num_layers=2)
    plain, fp8 = engine_run(str(float_dir))[1], engine_run(str(float_dir), quantization="fp8")[1]
    quantize = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=[1, 64])))
    for mine, base in zip(fp8.model.layers, plain.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            for e, weight in enumerate(getattr(base.mlp.experts, name)):
                pair = quantize.convert({"w.weight": weight})
                expected = pair["w.weight"].float() * pair["w.weight_scale_inv"]
                assert torch.equal(getattr(mine.mlp.experts, name)[e], expected), (name, e)
        assert torch.equal(mine.mlp.gate.weight, base.mlp.gate.weight)  # the router stays float
        assert torch.equal(mine.mlp.experts.gate_up_proj_bias, base.mlp.experts.gate_up_proj_bias)


@slow
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_quantized_moe_splits_over_tensor_parallel_ranks(float_dirs, tmp_path, quantization):
    """Each expert's full weight is dequantized (or round-tripped by --quantization fp8, per whole row) before
    the rank's slice of the intermediate dimension is cut: the same tokens as one rank."""
    float_dir = float_dirs("qwen3_moe")
    model_dir = ct_checkpoint(float_dir, "w4a16_group_asym", tmp_path / "ct")[0] if quantization is None else str(float_dir)
    expected = engine_greedy(model_dir, quantization=quantization)
    assert engine_greedy(model_dir, quantization=quantization, tensor_parallel_size=2) == expected


@slow
def test_bf16_keeps_dense_layers_quantized_and_dequantizes_the_experts(float_dirs, tmp_path, monkeypatch):
    """In bf16 the attention projections take the kept-int4 CPU kernel; the experts are still stacked float."""
    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL")  # the kernel choice itself, not the autouse fixture's
    model_dir, _ = ct_checkpoint(float_dirs("qwen3_moe"), "w4a16_group_sym", tmp_path / "ct")
    llm = LLM(model_dir, max_model_len=64, num_kv_blocks=16, dtype="bfloat16")
    model = llm.engine.runner.model
    assert model.quant_kernels and all(".self_attn." in name for name in model.quant_kernels)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert len(llm.generate([{"prompt_token_ids": PROMPTS[0]}])[0].outputs[0].token_ids) > 0


@pytest.mark.parametrize("dynamic, refused", [({"-:.*mlp.gate": {}}, False),
                                              ({"-:.*mlp.gate": {}, "+:.*down_proj": {"bits": 8}}, True)])
def test_gptq_dynamic_rules_skip_modules_or_are_refused(dynamic, refused):
    """GPTQModel skips MoE routers with "-:" rules (the tensors are float: read as stored); a rule that changes
    bits per module cannot be read with one config, so it is a start-up error, not a misread weight."""
    from kubeinfer.engine.model_executor.layers.quantization import QuantizationError
    from kubeinfer.engine.model_executor.layers.quantization.gptq import GptqConfig

    config = {"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": dynamic}
    if refused:
        with pytest.raises(QuantizationError, match=r"per-module overrides \(dynamic: \+:\.\*down_proj\)"):
            GptqConfig.from_dict(config)
    else:
        assert GptqConfig.from_dict(config).bits == 4
