"""compressed-tensors W4A8 checkpoints (llm-compressor's W4A8 scheme: `pack-quantized` int4 weights, symmetric, by
group or channel; int8 dynamic per-token symmetric input activations) served on a float32 CPU model by the exact
integer product (layers/quantization/w4a8.py), the int4 weight held packed.

Reference nobody here wrote: transformers loading the checkpoint with `CompressedTensorsConfig()` (its default:
the package's forward wrapper decompresses the weights and fake-quantizes each quantized layer's input).
`CompressedTensorsConfig(run_compressed=False)` only sets `dequantize=True` in the installed transformers, which
leaves the activations unquantized (test_quantized_w8a8.py; its logits are the guard below).

Greedy tokens equal the reference's, near ties excused as in test_quantized_w8a8.py where the reference's top two
logits are within MAX_GAP (the activation quantization's noise, measured below; a tie of 0.073 was met).
Log-probabilities (the first token's top 5 over 8 prompts): within MAX_GAP = 0.15 of the reference's at most and
MEAN_GAP = 0.04 on average. Measured, largest / mean: 0.076 / 0.018 at groups of 128, 0.100 / 0.019 at groups of
32, 0.056 / 0.018 per channel; the engine's fake quantization (the reference's own computation) 0.051-0.064 /
0.006. A layer's output is the reference's within ~3e-7 of its range (float rounding), but where a rounding moves
an activation across an int8 rounding boundary the next layer sees a whole quantization step: the gaps are those
of activation quantization, not of the product. The weight-only reference (activations unquantized) is 0.25-0.30
/ 0.08-0.09 away: outside both bounds (the guard). Layouts the product does not take run as
before (the dequantized weight, fake-quantized input), as do KUBEINFER_W8A8_KERNEL=fake_quant and
KUBEINFER_QUANT_KERNEL=dequantized; KUBEINFER_W8A8_KERNEL=int_mm gives torch._int_mm's twin (the same bits)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_checkpoints import (
    SHAPE,
    assert_greedy_equal_but_near_ties,
    ct_compress,
    ct_scheme,
    engine_greedy,
    float_weights,
    hf_greedy,
    write_checkpoint,
)

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.platforms.cpu.native import ops as native_ops

NATIVE = pytest.mark.skipif(not native_ops.available(), reason="no C compiler: the native kernels do not build")
TOKEN = dict(type="int", strategy="token", dynamic=True, symmetric=True)
MAX_GAP, MEAN_GAP = 0.15, 0.04  # log-probabilities (module docstring)
PROMPTS = [list(range(3 + i, 40 + 3 * i)) for i in range(8)]


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    return build_random_model(tmp_path_factory.mktemp("w4a8") / "float", "qwen3", tokenizer=False, seed=29, **SHAPE)


def w4a8_checkpoint(float_dir, name: str, group: int | None = 128, inputs: dict | None = None) -> str:
    """The W4A8 checkpoint by the compressed-tensors package (int4 by `group` columns, or per channel where None;
    `inputs`: other input_activations), made once per module under `name`."""
    dst = float_dir.parent / name
    if dst.exists():
        return str(dst)
    config = ct_scheme("pack-quantized", 4, "int", "group" if group else "channel", True, group, activations=True)
    config["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "observer": None, **(inputs or TOKEN)}
    return write_checkpoint(float_dir, dst, ct_compress(float_weights(float_dir), config), config)


def hf_w4a8(model_dir, fake_quant_activations: bool = True):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    config = CompressedTensorsConfig() if fake_quant_activations else CompressedTensorsConfig(run_compressed=False)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=config).eval()


def first_logprob_gaps(llm, reference) -> tuple[float, float]:
    """The largest and the mean gap between the engine's top-5 log-probabilities of the first token and the
    reference's, over PROMPTS."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    gaps = []
    for prompt, output in zip(PROMPTS, outputs):
        with torch.inference_mode():
            expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, -1].float(), -1)
        gaps += [abs(entry.logprob - expected[token].item()) for token, entry in output.outputs[0].logprobs[0].items()]
    return max(gaps), sum(gaps) / len(gaps)


def kernels_of(llm) -> set[str]:
    return set(llm.engine.runner.model.activation_schemes.values())


@NATIVE
@pytest.mark.parametrize("group", [128, pytest.param(None, id="channel"), pytest.param(32, marks=pytest.mark.slow)])
def test_w4a8_runs_the_exact_int4_product_and_equals_the_reference(float_dir, group):
    """The default on a float32 CPU model: every decoder linear through the native kernel, its weight packed (half
    a byte a weight, the float weight gone); the reference's tokens and, within MAX_GAP and MEAN_GAP, its
    log-probabilities; the weight-only reference (activations unquantized) is outside both (the guard)."""
    from kubeinfer.engine.core.model_setup import memory_summary

    model_dir = w4a8_checkpoint(float_dir, f"w4a8_{group}", group)
    llm = LLM(model_dir, max_model_len=128, num_kv_blocks=64)
    model = llm.engine.runner.model
    assert kernels_of(llm) == {"int8 dynamic per token (w4a8_vnni)"}
    assert "8 linear layers with activations int8 dynamic per token (w4a8_vnni)" in memory_summary(llm.engine.runner,
                                                                                                    64)
    down = model.model.layers[0].mlp.down_proj  # [hidden, intermediate]: half a byte a weight
    assert down.weight.device.type == "meta" and down.qweight_int4.dtype == torch.uint8
    assert down.qweight_int4.numel() == SHAPE["hidden_size"] * SHAPE["intermediate_size"] // 2
    assert any(p is down.qweight_int4 for p in model.parameters())
    reference = hf_w4a8(model_dir)
    largest, mean = first_logprob_gaps(llm, reference)
    print(f"W4A8 group {group}: first-token log-prob gaps: largest {largest:.3f}, mean {mean:.3f}")
    assert largest <= MAX_GAP and mean <= MEAN_GAP
    largest, mean = first_logprob_gaps(llm, hf_w4a8(model_dir, fake_quant_activations=False))
    assert largest > MAX_GAP and mean > MEAN_GAP
    llm.shutdown()
    assert_greedy_equal_but_near_ties(engine_greedy(model_dir), hf_greedy(reference), reference, tie=MAX_GAP)


@NATIVE
def test_the_int_mm_twin_gives_the_native_kernels_tokens(float_dir, monkeypatch):
    """KUBEINFER_W8A8_KERNEL=int_mm: torch._int_mm per weight group (w4a8_ops.int_mm_product), the same bits as the
    native kernel, so the same tokens (no ties to excuse), its int4 weight held one byte a weight."""
    model_dir = w4a8_checkpoint(float_dir, "w4a8_128")
    native = engine_greedy(model_dir)
    monkeypatch.setenv("KUBEINFER_W8A8_KERNEL", "int_mm")
    llm = LLM(model_dir, max_model_len=64, num_kv_blocks=16)
    assert kernels_of(llm) == {"int8 dynamic per token (w4a8_int_mm)"}
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.qweight_t.dtype == torch.int8
    llm.shutdown()
    assert engine_greedy(model_dir) == native


@pytest.mark.parametrize("env, kernel", [
    ({"KUBEINFER_W8A8_KERNEL": "fake_quant"}, "fake_quant"),
    ({"KUBEINFER_QUANT_KERNEL": "dequantized"}, "fake_quant"),
    pytest.param({"KUBEINFER_QUANT_KERNEL": "cpu_int4_vnni"}, "w4a8_vnni", marks=NATIVE)])
def test_the_kernel_switches_are_honoured(float_dir, monkeypatch, env, kernel):
    """fake_quant (KUBEINFER_W8A8_KERNEL) and dequantized weights (KUBEINFER_QUANT_KERNEL) run the reference's own
    computation over the float weight, as before (down_proj: two groups of 128; with dequantized weights a layer of
    one group per row is an int8 weight per channel, which w8a8.py recovers for its int8 product, as before); a
    native CPU kernel named in KUBEINFER_QUANT_KERNEL leaves a W8A8 checkpoint's layers to their exact product,
    as for int8."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    llm = LLM(w4a8_checkpoint(float_dir, "w4a8_128"), max_model_len=64, num_kv_blocks=16)
    schemes = llm.engine.runner.model.activation_schemes
    assert schemes["model.layers.0.mlp.down_proj"] == f"int8 dynamic per token ({kernel})"
    assert (kernel == "w4a8_vnni") == any("w4a8" in s for s in schemes.values())
    down = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert (down.weight.device.type == "meta") == (kernel != "fake_quant")


@pytest.mark.parametrize("name, inputs", [
    ("asym", dict(TOKEN, symmetric=False)),
    pytest.param("group_inputs", dict(TOKEN, strategy="group", group_size=64), marks=pytest.mark.slow)])
def test_activation_layouts_the_product_does_not_take_run_as_before(float_dir, monkeypatch, caplog, name, inputs):
    """Asymmetric or grouped dynamic activations: the held int4 weight is dequantized into the layer and the
    input fake-quantized (the reference's computation), which still gives the reference's tokens; the start-up
    log says so, naming the scheme."""
    import logging

    from kubeinfer.engine.model_executor.layers.quantization import w4a8

    monkeypatch.setattr(w4a8, "_SAID", set())  # said once per scheme in a process
    model_dir = w4a8_checkpoint(float_dir, f"w4a8_{name}", inputs=inputs)
    with caplog.at_level(logging.INFO, logger=w4a8.__name__):
        llm = LLM(model_dir, max_model_len=64, num_kv_blocks=16)
    scheme = next(iter(kernels_of(llm))).rsplit(" (", 1)[0]
    assert f"int4 weights with {scheme} activations: not the exact W4A8 product" in caplog.text
    assert {s.rsplit(" (", 1)[1] for s in kernels_of(llm)} == {"fake_quant)"}
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    llm.shutdown()
    reference = hf_w4a8(model_dir)
    assert_greedy_equal_but_near_ties(engine_greedy(model_dir), hf_greedy(reference), reference, tie=MAX_GAP)


@pytest.mark.slow
def test_static_activation_scales_run_as_before(float_dir):
    """Static per-tensor input scales (calibrated by the package's calculate_qparams, test_quantized_w8a8.py)."""
    from quant_checkpoints import ct_activation_args
    from test_quantized_w8a8 import static_inputs

    model_dir = w4a8_checkpoint(float_dir, "w4a8_static", inputs=dict(type="int", strategy="tensor", dynamic=False))
    weights = float_weights(model_dir)
    weights.update(static_inputs(float_dir, ct_activation_args(type="int", strategy="tensor", dynamic=False)))
    config = json.loads((Path(model_dir) / "config.json").read_text())["quantization_config"]
    static = write_checkpoint(float_dir, float_dir.parent / "w4a8_static_scaled", weights, config)
    llm = LLM(static, max_model_len=64, num_kv_blocks=16)
    assert kernels_of(llm) == {"int8 static per tensor (fake_quant)"}
    llm.shutdown()
    reference = hf_w4a8(static)
    assert_greedy_equal_but_near_ties(engine_greedy(static), hf_greedy(reference), reference, tie=MAX_GAP)


@NATIVE
def test_w4a8_over_two_ranks_equals_the_reference(float_dir):
    """Tensor parallelism: each rank holds its slice of the int4 weight packed (q/k/v and gate/up their rows with
    their scales; o_proj its 64 of 128 input columns, a group of 128 cut in two and regrouped as two groups of 64,
    IntWeight.narrow; down_proj its 128 of 256, one group), and a row-parallel rank quantizes its slice of each
    token with the whole token's range (w8a8_tp). Greedy tokens at tensor_parallel_size 2 equal the reference's
    and the one-rank engine's, near ties excused (the ranks' partial sums add in another order)."""
    from test_quantized_w8a8_tp import rank_model

    model_dir = w4a8_checkpoint(float_dir, "w4a8_128")
    for rank in (0, 1):
        model = rank_model(model_dir, rank, 2)
        assert set(model.activation_schemes.values()) == {"int8 dynamic per token (w4a8_vnni)"}
        o_proj = model.model.layers[0].self_attn.o_proj
        assert o_proj.quant_method.group_size == 64 and o_proj.qweight_int4.numel() == SHAPE["hidden_size"] * 64 // 2
    reference = hf_w4a8(model_dir)
    two = engine_greedy(model_dir, tensor_parallel_size=2)
    assert_greedy_equal_but_near_ties(two, hf_greedy(reference), reference, tie=MAX_GAP)
    assert_greedy_equal_but_near_ties(two, engine_greedy(model_dir), reference, tie=MAX_GAP)


@pytest.mark.slow  # as W8A8's (test_quantized_w8a8.py)
def test_lora_over_a_w4a8_base_equals_peft_over_the_reference(float_dir, tmp_path):
    """The adapter reads the unquantized input beside the int4 product, as PEFT does over the reference (its LoRA
    layer calls the wrapped base layer, whose compressed-tensors forward quantizes the input, and feeds lora_A
    the input as it came)."""
    from lora_helpers import ADAPTERS, make_peft_adapter
    from lora_helpers import PROMPTS as LORA_PROMPTS
    from lora_helpers import hf_greedy as peft_greedy
    from peft import PeftModel

    from kubeinfer.engine.lora.request import LoRARequest

    model_dir = w4a8_checkpoint(float_dir, "w4a8_128")
    make_peft_adapter(float_dir, tmp_path / "adapter", seed=5, **ADAPTERS["all"])
    base = hf_w4a8(model_dir)
    with torch.no_grad():  # the package's wrapper decompresses the packed weights at the first forward: PEFT
        base(torch.tensor([[1]]))  # wraps layers that have a weight
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    expected = [peft_greedy(peft, p) for p in LORA_PROMPTS]
    llm = LLM(model_dir, max_model_len=64, num_kv_blocks=32, enable_lora=True)
    assert kernels_of(llm) <= {"int8 dynamic per token (w4a8_vnni)", "int8 dynamic per token (w4a8_int_mm)"}
    outputs = llm.generate([{"prompt_token_ids": p} for p in LORA_PROMPTS],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")))
    assert [o.outputs[0].token_ids for o in outputs] == expected
