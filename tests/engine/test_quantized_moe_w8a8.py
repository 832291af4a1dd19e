"""W8A8 inside the MoE experts (issue 29): FP8 MoE checkpoints (block-wise, `activation_scheme: dynamic`, as
Qwen3-30B-A3B-FP8 ships), `--quantization fp8` on a float MoE checkpoint, and compressed-tensors W8A8 (int8
and fp8) MoE checkpoints, served with each expert's inputs quantized as the format defines them.

The reference: transformers loading the same checkpoint with dequantized weights (`FineGrainedFP8Config(
dequantize=True)`, `CompressedTensorsConfig(dequantize=True)`) into its eager experts (one expert at a time,
`F.linear` on each expert's slice of the stacked weights), every product's input fake-quantized by the
compressed-tensors package's functions: the dense projections' by forward pre-hooks (quant_checkpoints.
fake_quantize_inputs), the experts' by intercepting each F.linear call of the experts' forward and telling
the expert and projection from the weight slice it multiplies. A token's hidden state is quantized as a
[1, tokens, hidden] input, per token (or per token group) as the format defines: the package itself, fed
the 2-D [tokens, hidden] block transformers 4 passed each expert, would take one scale over all of them
(compute_dynamic_scales_and_zp keeps dims 0 and 1 only), which no serving engine does.
Near ties are excused as in test_quantized_w8a8.py. One case per format runs in the default suite, the rest
are slow. The kernels and the refusals, at the layer: test_fused_moe_w8a8.py."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from quant_checkpoints import (
    assert_greedy_equal_but_near_ties,
    ct_activation_args,
    ct_compress,
    ct_fake_quantize,
    ct_scheme,
    engine_greedy,
    fake_quantize_inputs,
    float_weights,
    hf_greedy,
    is_decoder_linear,
    write_checkpoint,
)
from safetensors.torch import load_file

# Every input dimension 64: [32, 32] fp8 blocks give two activation groups per row.
SHAPE = dict(hidden_size=64, intermediate_size=64, num_heads=4, num_kv_heads=2, num_layers=2)
FAMILIES = {"qwen3_moe": {"moe_intermediate_size": 64}, "mixtral": {},
            "qwen2_moe": {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}}
ROUTERS = {"qwen3_moe": ("re:.*mlp.gate$",), "mixtral": ("re:.*block_sparse_moe.gate$",),
           "qwen2_moe": ("re:.*mlp.gate$", "re:.*shared_expert_gate$")}
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    root, built = tmp_path_factory.mktemp("moe_w8a8"), {}

    def get(family: str):
        if family not in built:
            built[family] = build_random_model(root / family, family, tokenizer=False, seed=29, **SHAPE,
                                               **FAMILIES[family])
        return built[family]
    return get


@contextmanager
def _linear_inputs_seen(experts, input_of):
    """F.linear, while the experts' forward runs, with each input x replaced by input_of(projection, expert)(x),
    the expert told from the stacked weight's slice it multiplies."""
    real = torch.nn.functional.linear

    def linear(x, weight, bias=None):
        for projection in ("gate_up_proj", "down_proj"):
            stacked = getattr(experts, projection)
            if weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr():
                expert = (weight.data_ptr() - stacked.data_ptr()) // (stacked.stride(0) * stacked.element_size())
                seen = input_of(projection, int(expert))(x)
                x = x if seen is None else seen
        return real(x, weight, bias)

    torch.nn.functional.linear = linear
    try:
        yield
    finally:
        torch.nn.functional.linear = real


def _fake_quantizer(args, scale, zero):
    """x [tokens, D] as the package quantizes a [1, tokens, D] layer input."""
    return lambda x: ct_fake_quantize(x.unsqueeze(0), args, scale, zero)[0]


def quantize_expert_inputs(model, args_of) -> None:
    """transformers' eager experts with each product's input fake-quantized by the package:
    `args_of(layer, projection, expert)` -> (QuantizationArgs, scale, zero) for `gate_up_proj` / `down_proj`."""
    model.set_experts_implementation("eager")
    for index, layer in enumerate(model.model.layers):
        block = getattr(layer, "mlp", None)
        experts = getattr(block, "experts", None)
        if experts is None:
            continue
        forward = experts.forward

        def wrapped(*args, _forward=forward, _experts=experts, _layer=index, **kwargs):
            with _linear_inputs_seen(_experts, lambda p, e: _fake_quantizer(*args_of(_layer, p, e))):
                return _forward(*args, **kwargs)
        experts.forward = wrapped


def fp8_moe_reference(model_dir, quantize_experts: bool = True):
    """FineGrainedFP8Config(dequantize=True), every decoder projection's input (experts' included) e4m3 per
    token per group of the weight block's columns (per token without blocks)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    block = json.loads((Path(model_dir) / "config.json").read_text())["quantization_config"]["weight_block_size"]
    args = ct_activation_args(type="float", strategy="group", group_size=block[1]) if block else \
        ct_activation_args(type="float", strategy="token")
    fake_quantize_inputs(model, lambda name: (args, None, None))
    if quantize_experts:
        quantize_expert_inputs(model, lambda layer, projection, expert: (args, None, None))
    else:
        model.set_experts_implementation("eager")
    return model


def fp8_moe_checkpoint(float_dir, dst, block=(32, 32)) -> str:
    """Every decoder projection, experts included (Mixtral's w1/w3/w2), through transformers' FP8 quantizer."""
    from test_quantized_fp8 import fp8_config
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    block = list(block) if block else None
    quantize = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=block)))
    weights = {}
    for key, tensor in float_weights(float_dir).items():
        weights.update(quantize.convert({key: tensor}) if is_decoder_linear(key) else {key: tensor})
    return write_checkpoint(float_dir, dst, weights, fp8_config(block))


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("mixtral", marks=slow),
                                    pytest.param("qwen2_moe", marks=slow)])
def test_fp8_block_moe_checkpoint_quantizes_the_experts_inputs(float_dirs, tmp_path, family):
    """Qwen3-30B-A3B-FP8's format: block-wise weights, activations e4m3 per token per group of 32 (the
    block's columns) in the attention, the shared expert and every expert."""
    model_dir = fp8_moe_checkpoint(float_dirs(family), tmp_path / "fp8")
    reference = fp8_moe_reference(model_dir)
    assert_greedy_equal_but_near_ties(engine_greedy(model_dir), hf_greedy(reference), reference)


def test_unquantized_expert_inputs_would_fail_the_comparison(float_dirs, tmp_path, monkeypatch):
    """The guard: the reference moves with its experts' activation quantization, and the engine with its
    experts' inputs left in float (the dense projections still quantized) fails the comparison above."""
    from kubeinfer.engine.model_executor.layers.quantization import w8a8_experts

    model_dir = fp8_moe_checkpoint(float_dirs("qwen3_moe"), tmp_path / "fp8")
    reference, float_experts = fp8_moe_reference(model_dir), fp8_moe_reference(model_dir, quantize_experts=False)
    ids = torch.tensor([list(range(60, 100))])
    with torch.no_grad():
        assert (reference(ids).logits - float_experts(ids).logits).abs().max().item() > 0.05
    monkeypatch.setattr(w8a8_experts.ExpertSchemes, "install", lambda self: {})
    with pytest.raises(AssertionError):
        assert_greedy_equal_but_near_ties(engine_greedy(model_dir), hf_greedy(reference), reference)


@slow
def test_fp8_per_tensor_moe_checkpoint_quantizes_per_token(float_dirs, tmp_path):
    model_dir = fp8_moe_checkpoint(float_dirs("qwen3_moe"), tmp_path / "fp8", block=None)
    reference = fp8_moe_reference(model_dir)
    assert_greedy_equal_but_near_ties(engine_greedy(model_dir), hf_greedy(reference), reference)


@slow
def test_fp8_flag_on_float_gpt_oss_quantizes_its_experts_inputs(tmp_path):
    """--quantization fp8 on float gpt-oss (biases, clamped SwiGLU, experts stacked [E, in, out]): the
    reference is transformers' float model with every projection round-tripped per output row by its FP8
    quantizer (the weights test_quantized_moe.py checks bit for bit), the attention projections' inputs
    fake-quantized per token by the package, and, per token too, the experts' hidden states (the same for
    every expert) and each expert's gated output before its down product (`_apply_gate`'s result: gpt-oss's
    eager experts multiply with `@`, not F.linear)."""
    from test_quantized_moe import hf_float
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    from kubeinfer.dev.testing.random_model import build_random_model

    float_dir = build_random_model(tmp_path / "float", "gpt_oss", tokenizer=False, seed=3, hidden_size=64,
                                   intermediate_size=64, num_heads=4, num_kv_heads=2, num_layers=2)
    reference = hf_float(str(float_dir))
    quantize = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=[1, 64])))

    def roundtrip(weight):  # [out, in]
        pair = quantize.convert({"w.weight": weight})
        return pair["w.weight"].float() * pair["w.weight_scale_inv"]
    args = ct_activation_args(type="float", strategy="token")
    quantized = _fake_quantizer(args, None, None)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear) and name.endswith("_proj"):
                module.weight.copy_(roundtrip(module.weight))
        for layer in reference.model.layers:
            experts = layer.mlp.experts
            for stacked in (experts.gate_up_proj, experts.down_proj):  # [E, in, out]: rows of the transpose
                for e in range(stacked.shape[0]):
                    stacked[e].copy_(roundtrip(stacked[e].t().contiguous()).t())
            experts.register_forward_pre_hook(lambda m, inputs: (quantized(inputs[0]), *inputs[1:]))
            apply_gate = experts._apply_gate
            experts._apply_gate = lambda gate_up, _apply=apply_gate: quantized(_apply(gate_up))
    fake_quantize_inputs(reference, lambda name: (args, None, None))
    tokens = engine_greedy(str(float_dir), quantization="fp8")
    assert_greedy_equal_but_near_ties(tokens, hf_greedy(reference), reference)


# --- compressed-tensors W8A8 (int-quantized, float-quantized) MoE checkpoints ---
CT_MOE = {  # name: (weights' type, input_activations); static scales from calibration (moe_static_inputs)
    "int8_dynamic": ("int", dict(type="int", strategy="token", dynamic=True, symmetric=True)),
    "fp8_dynamic": ("float", dict(type="float", strategy="token", dynamic=True, symmetric=True)),
    "int8_static_asym": ("int", dict(type="int", strategy="tensor", dynamic=False, symmetric=False)),
    "fp8_static": ("float", dict(type="float", strategy="tensor", dynamic=False, symmetric=True)),
}


def _observed_inputs(float_dir) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """min and max of every decoder projection's input on a calibration prompt, the experts' per expert
    (checkpoint names: `...experts.E.gate_proj`, Mixtral's `block_sparse_moe.experts.E.w1`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    model.set_experts_implementation("eager")
    seen = {}

    def note(name, x):
        lo, hi = seen.get(name, (x.min(), x.max()))
        seen[name] = (torch.minimum(lo, x.min()), torch.maximum(hi, x.max()))
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name and name.endswith("_proj"):
            module.register_forward_pre_hook(lambda m, inp, n=name: note(n, inp[0]))
    mixtral = model.config.model_type == "mixtral"
    names = {"gate_up_proj": ("w1", "w3") if mixtral else ("gate_proj", "up_proj"),
             "down_proj": ("w2",) if mixtral else ("down_proj",)}
    block = "block_sparse_moe" if mixtral else "mlp"

    def observe(layer, projection, expert):
        def record(x):
            for n in names[projection]:
                note(f"model.layers.{layer}.{block}.experts.{expert}.{n}", x)
        return record
    for index, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        forward = experts.forward

        def wrapped(*args, _forward=forward, _experts=experts, _layer=index, **kwargs):
            with _linear_inputs_seen(_experts, lambda p, e: observe(_layer, p, e)):
                return _forward(*args, **kwargs)
        experts.forward = wrapped
    with torch.no_grad():
        model(torch.arange(1, 65).reshape(1, -1))
    return seen


def moe_static_inputs(float_dir, args) -> dict:
    """Per-tensor input qparams of every projection (each expert its own) by the package's calculate_qparams."""
    from compressed_tensors.quantization.utils import calculate_qparams

    out = {}
    for name, (lo, hi) in _observed_inputs(float_dir).items():
        scale, zero = calculate_qparams(lo.reshape(1), hi.reshape(1), args)
        out[f"{name}.input_scale"] = scale.to(torch.float32)
        if not args.symmetric:
            out[f"{name}.input_zero_point"] = zero.to(torch.int8)
    return out


def ct_moe_checkpoint(float_dir, name: str, dst) -> str:
    kind, inputs = CT_MOE[name]
    config = ct_scheme("int-quantized" if kind == "int" else "float-quantized", 8, kind, "channel", True, None,
                       activations=True, ignore=ROUTERS[float_dir.name])
    config["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "observer": None, **inputs}
    weights = ct_compress(float_weights(float_dir), config)
    if not inputs["dynamic"]:
        weights.update(moe_static_inputs(float_dir, ct_activation_args(**inputs)))
    return write_checkpoint(float_dir, dst, weights, config)


def ct_decompressed(model_dir) -> dict:
    """Every quantized weight through its format's registered compressor's `decompress` (the package's own),
    the other tensors as stored, quantization parameters dropped."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    config = json.loads((Path(model_dir) / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
    compressor = BaseCompressor.get_value_from_registry(config["format"])
    tensors = float_weights(model_dir)
    out = {}
    for key, tensor in tensors.items():
        prefix, _, leaf = key.rpartition(".")
        if leaf == "weight" and f"{prefix}.weight_scale" in tensors:
            state = {n: tensors[f"{prefix}.{n}"] for n in ("weight", "weight_scale", "weight_zero_point")
                     if f"{prefix}.{n}" in tensors}
            out[key] = compressor.decompress(state, scheme)["weight"].to(torch.float32)
        elif not leaf.startswith(("weight_", "input_")):
            out[key] = tensor
    return out


def ct_moe_reference(model_dir, float_dir, dst):
    """The package's decompression of the checkpoint (transformers 5.24 cannot load int-quantized or
    float-quantized experts: its concatenation finds no `weight` tensors for them; the package's whole-model
    dequantizer takes every `weight` of these formats for a quantized one, embeddings included), loaded by
    transformers as a float model, every projection's input fake-quantized by the package with the
    checkpoint's scheme and static qparams."""
    from test_quantized_moe import hf_float

    dense = ct_decompressed(model_dir)
    assert set(dense) == set(float_weights(float_dir))
    model = hf_float(write_checkpoint(float_dir, dst, dense, None))
    group = json.loads((Path(model_dir) / "config.json").read_text())["quantization_config"]["config_groups"]
    args = ct_activation_args(**{k: v for k, v in group["group_0"]["input_activations"].items() if k != "observer"})
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    mixtral = model.config.model_type == "mixtral"

    def qparams(name):
        if args.dynamic:
            return args, None, None
        return args, tensors[f"{name}.input_scale"], tensors.get(f"{name}.input_zero_point")
    fake_quantize_inputs(model, qparams)
    block = "block_sparse_moe" if mixtral else "mlp"
    first = {"gate_up_proj": "w1" if mixtral else "gate_proj", "down_proj": "w2" if mixtral else "down_proj"}
    quantize_expert_inputs(model, lambda layer, projection, expert: qparams(
        f"model.layers.{layer}.{block}.experts.{expert}.{first[projection]}"))
    return model


@pytest.mark.parametrize("family, name", [
    ("qwen3_moe", "int8_static_asym"),  # each expert its own static scale and zero point
    pytest.param("qwen3_moe", "int8_dynamic", marks=slow),
    pytest.param("qwen3_moe", "fp8_dynamic", marks=slow),
    pytest.param("mixtral", "fp8_static", marks=slow),
    pytest.param("qwen2_moe", "int8_dynamic", marks=slow),
])
def test_compressed_tensors_w8a8_moe_equals_the_reference(float_dirs, tmp_path, family, name):
    float_dir = float_dirs(family)
    model_dir = ct_moe_checkpoint(float_dir, name, tmp_path / "ct")
    down = "model.layers.1." + ("block_sparse_moe.experts.3.w2" if family == "mixtral" else "mlp.experts.3.down_proj")
    assert float_weights(model_dir)[f"{down}.weight"].dtype in (torch.int8, torch.float8_e4m3fn)
    reference = ct_moe_reference(model_dir, float_dir, tmp_path / "dense")
    assert_greedy_equal_but_near_ties(engine_greedy(model_dir), hf_greedy(reference), reference)
