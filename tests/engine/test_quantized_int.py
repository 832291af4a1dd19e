"""compressed-tensors, AWQ and GPTQ checkpoints (issue 29) of tiny random models, served dequantized.

References nobody here wrote:
- compressed-tensors: the checkpoints are written by the `compressed-tensors` package (its min-max qparams
  and its registered compressor per format); the reference is transformers loading them with
  `CompressedTensorsConfig(dequantize=True)` (weight-only formats) or `CompressedTensorsConfig()` (W8A8: the
  package's forward wrapper fake-quantizes each layer's input, as the engine quantizes it; more W8A8 schemes
  in test_quantized_w8a8.py);
- AWQ: written by AutoAWQ's published GEMM layout (tests/quant_checkpoints.py); the reference is
  compressed-tensors' own AutoAWQ converter turning it into a pack-quantized checkpoint, loaded by
  transformers as above (AutoAWQ itself does not install without CUDA);
- GPTQ: written by AutoGPTQ's published layout (v1 zeros, g_idx); neither gptqmodel nor auto-gptq installs
  without CUDA, so the reference is transformers on the float weights (q - zero) * scale that the test
  computes from the integers before it packs them: it checks the engine's unpacking and group lookup."""
import json

import pytest
import torch
from quant_checkpoints import (
    SHAPE,
    assert_greedy_equal_but_near_ties,
    awq_pack,
    awq_to_compressed_tensors,
    ct_compress,
    ct_scheme,
    engine_greedy,
    float_weights,
    gptq_pack,
    hf_compressed_tensors,
    hf_greedy,
    write_checkpoint,
)

from kubeinfer.engine import LLM
from kubeinfer.engine.platforms.cpu.native.ops import unpack_int8

CT_SCHEMES = {  # name: (format, bits, type, strategy, symmetric, group_size, W8A8)
    "w4a16_group_sym": ("pack-quantized", 4, "int", "group", True, 32, False),
    "w4a16_group_asym": ("pack-quantized", 4, "int", "group", False, 64, False),
    "w4a16_channel_asym": ("pack-quantized", 4, "int", "channel", False, None, False),
    "w8a16_channel_sym": ("pack-quantized", 8, "int", "channel", True, None, False),
    "w8a16_group_asym": ("pack-quantized", 8, "int", "group", False, 128, False),
    "w8a8_int8": ("int-quantized", 8, "int", "channel", True, None, True),
    "w8a8_fp8": ("float-quantized", 8, "float", "channel", True, None, True),
    "w8a8_fp8_tensor": ("float-quantized", 8, "float", "tensor", True, None, True),
}


@pytest.fixture(autouse=True)
def dequantized_kernel(monkeypatch):
    """These tests hold the loader's dequantized weights and tokens to transformers' exactly; the kept-quantized
    kernels (on the CPU's float32, torch's products with bf16 activations) are tested in test_quantized_kept.py."""
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "dequantized")


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    return build_random_model(tmp_path_factory.mktemp("int") / "float", "qwen3", tokenizer=False, seed=29, **SHAPE)


def ct_checkpoint(float_dir, name: str, family_dir=None) -> str:
    source = family_dir or float_dir
    fmt, bits, kind, strategy, symmetric, group, w8a8 = CT_SCHEMES[name]
    config = ct_scheme(fmt, bits, kind, strategy, symmetric, group, activations=w8a8)
    return write_checkpoint(source, source.parent / f"ct_{name}", ct_compress(float_weights(source), config), config)


def assert_weights_equal(model, hf, rtol: float = 0.0) -> None:
    """Every fused projection of the engine equals the reference's q/k/v, gate/up, o and down Linear weights."""
    for layer, theirs in zip(model.model.layers, hf.model.layers):
        attn, mlp = theirs.self_attn, theirs.mlp
        pairs = {"qkv": (layer.self_attn.qkv_proj, [attn.q_proj, attn.k_proj, attn.v_proj]),
                 "gate_up": (layer.mlp.gate_up_proj, [mlp.gate_proj, mlp.up_proj]),
                 "o": (layer.self_attn.o_proj, [attn.o_proj]), "down": (layer.mlp.down_proj, [mlp.down_proj])}
        for name, (mine, parts) in pairs.items():
            expected = torch.cat([p.weight.float() for p in parts])
            weight = mine.weight
            if hasattr(mine, "qweight_t"):  # W8A8 int8 held for torch._int_mm
                weight = mine.qweight_t.t().float() * mine.weight_row_scale[:, None]
            elif hasattr(mine, "qweight_vnni"):  # or packed for the native kernel
                int8 = unpack_int8(mine.qweight_vnni, *mine.weight.shape)
                weight = int8.float() * mine.weight_row_scale[:, None]
            assert torch.allclose(weight, expected, rtol=rtol, atol=0), name


@pytest.mark.parametrize("name", list(CT_SCHEMES))
def test_compressed_tensors_checkpoint_equals_transformers_decompressed(float_dir, name):
    model_dir = ct_checkpoint(float_dir, name)
    w8a8 = CT_SCHEMES[name][-1]
    hf = hf_compressed_tensors(model_dir, weight_only=not w8a8)
    if w8a8:  # quantized activations: a rounding step may part the tokens at a near tie
        assert_greedy_equal_but_near_ties(engine_greedy(model_dir), hf_greedy(hf), hf)
    else:
        assert engine_greedy(model_dir) == hf_greedy(hf)
    assert_weights_equal(LLM(model_dir, max_model_len=64, num_kv_blocks=16).engine.runner.model, hf)


@pytest.fixture(scope="module")
def awq_dirs(float_dir):
    weights, config = awq_pack(float_weights(float_dir))
    converted, ct_config = awq_to_compressed_tensors(weights, config)
    return (write_checkpoint(float_dir, float_dir.parent / "awq", weights, config),
            write_checkpoint(float_dir, float_dir.parent / "awq_as_ct", converted, ct_config))


def test_awq_checkpoint_equals_compressed_tensors_conversion(awq_dirs):
    """The reference dequantizes in the scales' float16; the engine in float32: equal within fp16's rounding."""
    awq_dir, reference_dir = awq_dirs
    hf = hf_compressed_tensors(reference_dir, weight_only=True)
    assert engine_greedy(awq_dir) == hf_greedy(hf)
    assert_weights_equal(LLM(awq_dir, max_model_len=64, num_kv_blocks=16).engine.runner.model, hf, rtol=2 ** -10)


@pytest.mark.parametrize("bits, act_order", [(4, False), (8, False), (4, True)])
def test_gptq_checkpoint_equals_its_float_weights(float_dir, tmp_path, bits, act_order):
    from transformers import AutoModelForCausalLM

    weights, config, dense = gptq_pack(float_weights(float_dir), bits, 128, act_order, seed=bits)
    model_dir = write_checkpoint(float_dir, tmp_path / "gptq", weights, config)
    hf = AutoModelForCausalLM.from_pretrained(write_checkpoint(float_dir, tmp_path / "dense", dense, None),
                                              dtype=torch.float32).eval()
    assert engine_greedy(model_dir) == hf_greedy(hf)
    assert_weights_equal(LLM(model_dir, max_model_len=64, num_kv_blocks=16).engine.runner.model, hf)


@pytest.mark.parametrize("flag", ["awq", "awq_marlin"])
def test_quantization_flag_names_the_checkpoint_method_or_vllms_kernel_alias(awq_dirs, flag):
    assert engine_greedy(awq_dirs[0], quantization=flag) == engine_greedy(awq_dirs[0])


@pytest.mark.parametrize("flag", ["gptq", "compressed-tensors", "fp8"])
def test_quantization_flag_contradicting_the_checkpoint_names_both(awq_dirs, flag):
    with pytest.raises(ValueError, match=f"{flag!r} does not match the checkpoint's method 'awq'"):
        LLM(awq_dirs[0], max_model_len=64, num_kv_blocks=16, quantization=flag)


def test_a_calibrated_method_on_a_float_checkpoint_is_refused(float_dir):
    with pytest.raises(ValueError, match="'gptq' needs a checkpoint quantized with it.*only fp8 quantizes at load"):
        LLM(str(float_dir), max_model_len=64, num_kv_blocks=16, quantization="gptq")


@pytest.mark.parametrize("case, message", [
    ("awq_missing_scales", "has no scales in the checkpoint"),
    ("gptq_act_order_without_g_idx", "has desc_act but no g_idx"),
    ("gptq_3_bits", "3-bit weights: 2, 4 and 8 bits are served"),
    ("awq_gemv", "only AutoAWQ's 'gemm' layout is served"),
    ("ct_truncated_scale", "does not fit a 128x256 weight quantized by group (group_size 32)"),
    ("ct_missing_shape", "has no weight_shape"),
    ("ct_nvfp4", "format 'nvfp4-pack-quantized' (config group group_0) is not served"),
])
def test_broken_checkpoint_is_a_clear_start_up_error(float_dir, tmp_path, case, message):
    from kubeinfer.engine.model_executor.model_loader import ModelLoadError

    key = "model.layers.1.mlp.down_proj"
    if case.startswith("awq"):
        weights, config = awq_pack(float_weights(float_dir))
        if case == "awq_missing_scales":
            del weights[f"{key}.scales"]
        else:
            config["version"] = "gemv"
    elif case.startswith("gptq"):
        weights, config, _ = gptq_pack(float_weights(float_dir), 4, 128, act_order=True)
        if case == "gptq_act_order_without_g_idx":
            del weights[f"{key}.g_idx"]
        else:
            config["bits"] = 3
    else:
        config = ct_scheme("pack-quantized", 4, "int", "group", True, 32)
        weights = ct_compress(float_weights(float_dir), config)
        if case == "ct_truncated_scale":
            weights[f"{key}.weight_scale"] = weights[f"{key}.weight_scale"][:, :4]
        elif case == "ct_missing_shape":
            del weights[f"{key}.weight_shape"]
        else:
            config["format"] = config["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    model_dir = write_checkpoint(float_dir, tmp_path / case, weights, config)
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(model_dir, max_model_len=64, num_kv_blocks=16)


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3", "olmo2"])
def test_every_family_serves_w4a16(tmp_path, family):
    """The loader dequantizes per checkpoint tensor: Phi-3's fused qkv/gate_up and Gemma's norms alike."""
    from kubeinfer.dev.testing.random_model import build_random_model

    float_dir = build_random_model(tmp_path / "float", family, tokenizer=False, seed=7, **SHAPE)
    model_dir = ct_checkpoint(float_dir, "w4a16_group_asym")
    assert engine_greedy(model_dir) == hf_greedy(hf_compressed_tensors(model_dir, weight_only=True))


@pytest.mark.parametrize(("architecture", "method", "served_by"), [
    ("LlamaForCausalLM", "mxfp4", "GptOssForCausalLM"),  # gpt-oss's expert format, not a dense model's
    ("GptOssForCausalLM", "awq", "Qwen3MoeForCausalLM"),  # gpt-oss's experts: fp8 or its own mxfp4 only
])
def test_a_method_the_architecture_does_not_serve_is_refused_by_name(tmp_path, architecture, method, served_by):
    from kubeinfer.engine.model_executor.model_loader import ModelLoadError, inspect_model_dir

    config = {"architectures": [architecture], "model_type": "llama" if architecture.startswith("Llama") else
              "gpt_oss", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128,
              "quantization_config": {"quant_method": method, "bits": 4, "group_size": 32, "version": "gemm",
                                      "zero_point": True}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=rf"quantized with '{method}', which kubeinfer serves for .*{served_by}"):
        inspect_model_dir(tmp_path)


def test_a_quantized_checkpoint_splits_over_tensor_parallel_ranks(tmp_path):
    """On the CPU's float32 default the int weights are dequantized whole, then each rank keeps its slice of
    the float weight: still the reference's tokens (kept quantized per rank: tests/engine/test_quantized_tp.py)."""
    from kubeinfer.dev.testing.random_model import build_random_model

    float_dir = build_random_model(tmp_path / "float", "llama", tokenizer=False, seed=7, **SHAPE)
    model_dir = ct_checkpoint(float_dir, "w4a16_group_asym")
    assert engine_greedy(model_dir, tensor_parallel_size=2) == hf_greedy(hf_compressed_tensors(model_dir,
                                                                                              weight_only=True))
