"""FP8 checkpoints (issue 29): tiny random models quantized by transformers' own FP8 quantizer
(`Fp8Quantize`, the op `save_pretrained` uses for FineGrainedFP8Config), block-wise, per tensor and per
channel; the engine's greedy tokens equal transformers loading the same checkpoint with
`FineGrainedFP8Config(dequantize=True)`, each decoder linear's input fake-quantized to e4m3 as the format
defines it by the compressed-tensors package's functions (transformers' own FP8 kernels need a GPU and the
hub's Triton kernel): `activation_scheme: dynamic` per token and group of the weight block's columns (per
token without blocks), `static` the checkpoint's per-tensor activation_scale. Tokens may part at a near tie
(quant_checkpoints.assert_greedy_equal_but_near_ties). Broken checkpoints and contradicting flags fail at
start-up with a message that names what is wrong."""
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from quant_checkpoints import (
    assert_greedy_equal_but_near_ties,
    ct_activation_args,
    engine_greedy,
    fake_quantize_inputs,
    hf_greedy,
)
from safetensors.torch import load_file, save_file

from kubeinfer.engine import LLM, SamplingParams

# hidden = intermediate = heads * head_dim: every linear weight has 64 columns, so a [1, 64] block is one
# scale per output channel, a layout transformers reads.
SHAPE = dict(hidden_size=64, intermediate_size=64, num_heads=4, num_kv_heads=2, num_layers=2)


def fp8_quantize(weights: dict[str, torch.Tensor], block: list[int] | None) -> dict[str, torch.Tensor]:
    """The decoder layers' linear weights through transformers' quantizer; embeddings, norms, lm_head kept."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    quantize = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=block)))
    out = {}
    for key, tensor in weights.items():
        if ".layers." in key and key.endswith("_proj.weight"):
            pair = quantize.convert({key: tensor})
            assert pair[key].dtype == torch.float8_e4m3fn and len(pair) == 2
            out.update(pair)
        else:
            out[key] = tensor
    return out


def write_checkpoint(src, dst, weights, quantization_config) -> str:
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    if quantization_config is None:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def fp8_config(block) -> dict:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block,
            "modules_to_not_convert": ["lm_head"]}


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    return build_random_model(tmp_path_factory.mktemp("fp8") / "float", "qwen3", tokenizer=False, seed=29, **SHAPE)


def calibrated_activation_scales(float_dir) -> dict[str, torch.Tensor]:
    """`<layer>.activation_scale` of each decoder linear: the amax its input reaches on a calibration prompt,
    over 448; k_proj's and v_proj's a little off q_proj's (x1.25, x0.8), so the fused q/k/v layer needs each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    amax = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            module.register_forward_pre_hook(lambda m, inp, n=name: amax.__setitem__(n, inp[0].abs().max()))
    with torch.no_grad():
        model(torch.arange(1, 65).reshape(1, -1))
    factor = {"k_proj": 1.25, "v_proj": 0.8}
    return {f"{n}.activation_scale": (a / 448 * factor.get(n.rsplit(".", 1)[1], 1.0)).reshape(1).to(torch.float32)
            for n, a in amax.items()}


@pytest.fixture(scope="module")
def checkpoints(float_dir):
    """name -> an FP8 checkpoint directory (and its weights) built from the float model."""
    weights = load_file(str(float_dir / "model.safetensors"))
    made = {}
    for name, block in (("block", [32, 16]), ("tensor", None), ("channel_as_block", [1, 64])):
        quantized = fp8_quantize(weights, block)
        made[name] = (write_checkpoint(float_dir, float_dir.parent / name, quantized, fp8_config(block)), quantized)
    # Static activations: one e4m3 scale per layer, the calibrated amax / 448 (transformers' activation_scale,
    # vLLM's input_scale name the same number).
    static = {**made["block"][1], **calibrated_activation_scales(float_dir)}
    made["static"] = (write_checkpoint(float_dir, float_dir.parent / "static", static,
                                       {**fp8_config([32, 16]), "activation_scheme": "static"}), static)
    renamed = {k.replace("activation_scale", "input_scale"): v for k, v in static.items()}
    made["static_input_scale"] = (write_checkpoint(float_dir, float_dir.parent / "static_input_scale", renamed,
                                                   {**fp8_config([32, 16]), "activation_scheme": "static"}), renamed)
    # The same per-channel numbers in the `weight_scale` layout ([rows, 1], no weight_block_size): vLLM's fp8 form.
    channel = {(k.replace("weight_scale_inv", "weight_scale")): v for k, v in made["channel_as_block"][1].items()}
    made["channel"] = (write_checkpoint(float_dir, float_dir.parent / "channel", channel, fp8_config(None)), channel)
    return made


def hf_fp8(model_dir):
    """transformers' dequantized load, its decoder linears' inputs quantized as the checkpoint defines them."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    qc = json.loads((Path(model_dir) / "config.json").read_text())["quantization_config"]
    block = qc.get("weight_block_size")
    if qc["activation_scheme"] == "static":
        scales = {k.rsplit(".", 1)[0]: v for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()
                  if k.endswith(("activation_scale", "input_scale"))}
        args = ct_activation_args(type="float", strategy="tensor", dynamic=False)
        fake_quantize_inputs(model, lambda name: (args, scales[name].reshape(1), None))
    else:
        args = ct_activation_args(type="float", strategy="group", group_size=block[1]) if block else \
            ct_activation_args(type="float", strategy="token")
        fake_quantize_inputs(model, lambda name: (args, None, None))
    return model


def assert_fp8_greedy(model_dir, reference_dir=None, **kwargs) -> None:
    reference = hf_fp8(reference_dir or model_dir)
    assert_greedy_equal_but_near_ties(engine_greedy(model_dir, **kwargs), hf_greedy(reference), reference)


@pytest.mark.parametrize("name", ["block", "tensor", "channel_as_block"])
def test_fp8_checkpoint_greedy_equals_transformers_dequantized(checkpoints, name):
    assert_fp8_greedy(checkpoints[name][0])


@pytest.mark.parametrize("name", ["static", pytest.param("static_input_scale", marks=pytest.mark.slow)])
def test_static_activation_scales_are_honoured(checkpoints, name):
    assert_fp8_greedy(checkpoints[name][0])


def test_unquantized_activations_would_fail_the_fp8_comparison(checkpoints, monkeypatch):
    """The guard: the engine with its activations left in float (as it served fp8 before) parts from the
    reference at a token that is no near tie."""
    from kubeinfer.engine.model_executor.layers.quantization import w8a8

    monkeypatch.setattr(w8a8, "install", lambda *args: {})
    with pytest.raises(AssertionError):
        assert_fp8_greedy(checkpoints["block"][0])


def test_per_channel_weight_scale_layout_matches_the_block_layout(checkpoints):
    """`weight_scale` [rows, 1] (no weight_block_size) means what a [1, cols] block of weight_scale_inv means."""
    assert_fp8_greedy(checkpoints["channel"][0], checkpoints["channel_as_block"][0])


@pytest.mark.parametrize("ours, reference", [("block", "block"), ("tensor", "tensor"),
                                             ("channel", "channel_as_block")])
def test_dequantized_weights_equal_transformers_elementwise(checkpoints, ours, reference):
    """The loader's weights, not only the tokens: every projection equals transformers' dequantized Linear."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    hf = AutoModelForCausalLM.from_pretrained(checkpoints[reference][0], dtype=torch.float32,
                                              quantization_config=FineGrainedFP8Config(dequantize=True))
    model = LLM(checkpoints[ours][0], max_model_len=64, num_kv_blocks=16).engine.runner.model
    for layer, theirs in zip(model.model.layers, hf.model.layers):
        attn, mlp = theirs.self_attn, theirs.mlp
        fused = {"qkv": (layer.self_attn.qkv_proj, [attn.q_proj, attn.k_proj, attn.v_proj]),
                 "gate_up": (layer.mlp.gate_up_proj, [mlp.gate_proj, mlp.up_proj]),
                 "o": (layer.self_attn.o_proj, [attn.o_proj]), "down": (layer.mlp.down_proj, [mlp.down_proj])}
        for name, (mine, parts) in fused.items():
            assert torch.equal(mine.weight, torch.cat([p.weight for p in parts])), name


def test_quantization_flag_naming_the_checkpoint_method_is_accepted(checkpoints):
    assert engine_greedy(checkpoints["block"][0], quantization="fp8") == engine_greedy(checkpoints["block"][0])


@pytest.mark.parametrize("case, message", [
    ("missing_scale", "has no scale in the checkpoint"),
    ("truncated_scale", "needs (2, 4)"),
    ("no_quantization_config", "has no quantization_config"),
    ("static_activations", "static input activations but the checkpoint has no one-value input_scale"),
])
def test_broken_fp8_checkpoint_is_a_clear_start_up_error(checkpoints, float_dir, case, message):
    from kubeinfer.engine.model_executor.model_loader import ModelLoadError

    weights = dict(checkpoints["block"][1])
    config = fp8_config([32, 16])
    key = "model.layers.1.mlp.down_proj.weight_scale_inv"
    if case == "missing_scale":
        del weights[key]
    elif case == "truncated_scale":
        weights[key] = weights[key][:1]  # [2, 4] -> [1, 4]: half the rows have no scale
    elif case == "no_quantization_config":
        config = None
    else:
        config["activation_scheme"] = "static"
    model_dir = write_checkpoint(float_dir, float_dir.parent / f"broken_{case}", weights, config)
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        LLM(model_dir, max_model_len=64, num_kv_blocks=16)
    if case == "missing_scale":
        assert "model.layers.1.mlp.down_proj.weight" in str(error.value)


@pytest.mark.parametrize("method", ["mxfp4", "bitsandbytes", "hqq"])
def test_unserved_checkpoint_method_is_named_with_the_supported_list(float_dir, method):
    from kubeinfer.engine.model_executor.model_loader import ModelLoadError

    model_dir = write_checkpoint(float_dir, float_dir.parent / f"method_{method}",
                                 load_file(str(float_dir / "model.safetensors")),
                                 {"quant_method": method, "bits": 4, "group_size": 128})
    with pytest.raises(ModelLoadError, match=rf"quantized with '{method}'.*serves fp8, compressed-tensors, awq, gptq"):
        LLM(model_dir, max_model_len=64, num_kv_blocks=16)


@pytest.mark.parametrize("flag, message", [
    ("int3", "unknown method 'int3'; kubeinfer serves fp8, compressed-tensors, awq, gptq, mxfp4"),
    ("bitsandbytes", "'bitsandbytes' is not served yet; kubeinfer serves fp8"),
    ("mxfp4", "'mxfp4' names checkpoints stored in MXFP4 \\(gpt-oss's\\); this one is fp8"),
    ("awq", "'awq' does not match the checkpoint's method 'fp8'"),
])
def test_bad_quantization_flag_is_a_start_up_error(checkpoints, flag, message):
    with pytest.raises(ValueError, match=message):
        LLM(checkpoints["block"][0], max_model_len=64, num_kv_blocks=16, quantization=flag)


def test_fp8_flag_on_a_float_checkpoint_quantizes_per_channel_at_load(float_dir, checkpoints):
    """--quantization fp8 on the float model gives transformers' FP8 quantizer's per-channel model ([1, 64]
    blocks here) with dynamic activations (vLLM's online fp8 is W8A8): the same weights bit for bit, the same
    greedy tokens; embeddings and lm_head stay."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    reference = checkpoints["channel_as_block"][0]
    assert_fp8_greedy(str(float_dir), reference, quantization="fp8")
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32,
                                              quantization_config=FineGrainedFP8Config(dequantize=True))
    model = LLM(str(float_dir), max_model_len=64, num_kv_blocks=16, quantization="fp8").engine.runner.model
    float_model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    layer, theirs = model.model.layers[0], hf.model.layers[0]
    assert torch.equal(layer.mlp.down_proj.weight, theirs.mlp.down_proj.weight)
    assert torch.equal(layer.self_attn.qkv_proj.weight[:64], theirs.self_attn.q_proj.weight)
    assert not torch.equal(layer.mlp.down_proj.weight, float_model.model.layers[0].mlp.down_proj.weight)
    assert torch.equal(model.lm_head.weight, float_model.lm_head.weight)
    assert torch.equal(model.model.embed_tokens.weight, float_model.model.embed_tokens.weight)


def test_serve_takes_vllms_quantization_flag():
    import argparse

    from kubeinfer.engine.entrypoints.serve import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["m", "--quantization", "fp8"]).quantization == "fp8"
    assert parser.parse_args(["m", "-q", "fp8"]).quantization == "fp8"
    assert parser.parse_args(["m"]).quantization is None


def test_models_table_lists_the_served_methods():
    from kubeinfer.engine.model_executor.models.registry import feature_table

    dense = {row["quantized"] for row in feature_table() if "(MoE)" not in row["family"]}
    assert dense == {"fp8, compressed-tensors, awq, gptq"}
    moe = {row["architecture"]: row["quantized"] for row in feature_table() if "(MoE)" in row["family"]}
    assert moe["GptOssForCausalLM"] == "fp8, mxfp4"  # its experts' own format
    # the others' per-expert tensors go through every dense format's reader (tests/engine/test_quantized_moe.py)
    assert {served for name, served in moe.items() if name != "GptOssForCausalLM"} == dense
    methods = {row["architecture"]: row["quantized"].split(", ") for row in feature_table()}
    assert all("fp8" in served for served in methods.values())
    assert [name for name, served in methods.items() if "mxfp4" in served] == ["GptOssForCausalLM"]  # its experts


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma2", "gemma3", "phi3", "olmo2", "granite"])
def test_every_family_serves_block_fp8(tmp_path, family):
    """The loader dequantizes per checkpoint tensor, so every family takes it: Phi-3's fused qkv/gate_up too."""
    from kubeinfer.dev.testing.random_model import build_random_model

    float_dir = build_random_model(tmp_path / "float", family, tokenizer=False, seed=7, **SHAPE)
    weights = fp8_quantize(load_file(str(float_dir / "model.safetensors")), [32, 16])
    assert_fp8_greedy(write_checkpoint(float_dir, tmp_path / "fp8", weights, fp8_config([32, 16])))


def test_gemma3_multimodal_fp8_checkpoint_serves_its_text(tmp_path):
    """An FP8 Gemma3ForConditionalGeneration (language model quantized, vision tower float and unread) gives what
    transformers gives on the same language model as an FP8 Gemma3ForCausalLM checkpoint."""
    from kubeinfer.dev.testing.random_model import save_gemma3_multimodal

    from kubeinfer.dev.testing.random_model import build_random_model

    float_dir = build_random_model(tmp_path / "float", "gemma3", tokenizer=False, seed=3, tie_word_embeddings=True,
                                   **SHAPE)
    text_fp8 = write_checkpoint(float_dir, tmp_path / "text_fp8",
                                fp8_quantize(load_file(str(float_dir / "model.safetensors")), [32, 16]),
                                fp8_config([32, 16]))
    save_gemma3_multimodal(float_dir, tmp_path / "mm")
    weights = load_file(str(tmp_path / "mm" / "model.safetensors"))
    language = fp8_quantize({k: v for k, v in weights.items() if "language_model" in k}, [32, 16])
    mm_fp8 = write_checkpoint(tmp_path / "mm", tmp_path / "mm_fp8", {**weights, **language}, fp8_config([32, 16]))
    assert_fp8_greedy(mm_fp8, text_fp8)


def test_lora_on_an_fp8_checkpoint_equals_peft_on_transformers_dequantized(checkpoints, float_dir, tmp_path):
    """The adapter stays in float on the unquantized input over the W8A8 base: PEFT over the reference agrees."""
    from peft import PeftModel

    from kubeinfer.engine.lora.request import LoRARequest
    from lora_helpers import ADAPTERS, PROMPTS as LORA_PROMPTS, hf_greedy, make_peft_adapter

    make_peft_adapter(float_dir, tmp_path / "adapter", seed=5, **ADAPTERS["all"])
    model_dir = checkpoints["block"][0]
    hf = hf_fp8(model_dir)  # the base layers quantize their input; PEFT's adapters read it unquantized
    peft = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    expected = [hf_greedy(peft, p) for p in LORA_PROMPTS]
    llm = LLM(model_dir, max_model_len=64, num_kv_blocks=32, enable_lora=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in LORA_PROMPTS],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")))
    assert [o.outputs[0].token_ids for o in outputs] == expected
