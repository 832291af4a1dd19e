"""int8/int4 checkpoint weights kept quantized in memory (layers/quantization/linear_method.py): each linear
layer multiplies through its quant method, and the outputs are the reference's. With float32 activations
(the kernel forced by KUBEINFER_QUANT_KERNEL) torch's weight-only products are exact enough that greedy
tokens equal transformers' on the decompressed checkpoint. The default on the CPU's float32 runs the same
products with bf16 activations (`*_bf16`, the formats' "A16"): its log-probabilities stay within a measured bound
of transformers' float32 on the decompressed checkpoint. The default choice and the memory the start-up log
reports follow from the kernel."""
import pytest
import torch
from quant_checkpoints import (
    SHAPE,
    awq_pack,
    awq_to_compressed_tensors,
    ct_compress,
    ct_scheme,
    engine_greedy,
    float_weights,
    hf_compressed_tensors,
    hf_greedy,
    write_checkpoint,
)

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.platforms.cpu.native import a16_method
from kubeinfer.engine.platforms.cpu.native import ops as native_ops


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    root = tmp_path_factory.mktemp("kept")
    float_dir = build_random_model(root / "float", "qwen3", tokenizer=False, seed=29, **SHAPE)
    made = {"float": float_dir}
    for name, scheme in (("w4", ("pack-quantized", 4, "int", "group", False, 32)),
                         ("w8", ("pack-quantized", 8, "int", "channel", True, None))):
        config = ct_scheme(*scheme)
        made[name] = write_checkpoint(float_dir, root / name, ct_compress(float_weights(float_dir), config), config)
    weights, config = awq_pack(float_weights(float_dir))
    made["awq"] = write_checkpoint(float_dir, root / "awq", weights, config)
    made["awq_as_ct"] = write_checkpoint(float_dir, root / "awq_as_ct", *awq_to_compressed_tensors(weights, config))
    return made


NATIVE = pytest.mark.skipif(not native_ops.available(), reason="no C compiler: the native kernels do not build")


@pytest.mark.parametrize("name, kernel, reference", [
    ("w4", "cpu_int4", "w4"), ("w8", "cpu_int8", "w8"), ("awq", "cpu_int4", "awq_as_ct"),
    # the exact A16 product (platforms/cpu/native/a16_linear.c): activations rounded to bf16, float32 sums
    pytest.param("w4", "cpu_int4_a16", "w4", marks=NATIVE), pytest.param("w8", "cpu_int8_a16", "w8", marks=NATIVE),
    pytest.param("awq", "cpu_int4_a16", "awq_as_ct", marks=NATIVE)])
def test_kept_quantized_weights_give_the_reference_tokens(dirs, monkeypatch, name, kernel, reference):
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", kernel)
    llm = LLM(dirs[name], max_model_len=64, num_kv_blocks=16)
    model = llm.engine.runner.model
    assert set(model.quant_kernels.values()) == {kernel} and len(model.quant_kernels) == 4 * SHAPE["num_layers"]
    layer = model.model.layers[0].mlp.down_proj
    assert layer.weight.device.type == "meta" and not layer.qweight.is_floating_point()  # no float copy held
    hf = hf_compressed_tensors(dirs[reference], weight_only=True)
    if kernel.endswith("_a16"):
        a16_activations(hf)
    assert engine_greedy(dirs[name]) == hf_greedy(hf)


def a16_activations(hf) -> None:
    """transformers' decompressed model made the formats' A16 definition: each quantized projection's input rounded
    to bf16 (by torch), the product in float32 (lm_head is not quantized: left alone)."""
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            module.register_forward_pre_hook(lambda _, args: (args[0].to(torch.bfloat16).to(args[0].dtype),))


def test_default_choice_on_the_cpu(dirs, monkeypatch):
    """float32: int4 and int8 kept, bf16 activations (the native exact A16 product where the library builds, else
    torch's); bf16: int4 kept, int8 dequantized (measured)."""
    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    a16 = "a16" if a16_method.fast() else "bf16"
    for name, kernel in (("w4", f"cpu_int4_{a16}"), ("w8", f"cpu_int8_{a16}"), ("awq", f"cpu_int4_{a16}")):
        float32 = LLM(dirs[name], max_model_len=64, num_kv_blocks=16).engine.runner.model
        assert set(float32.quant_kernels.values()) == {kernel}
        assert float32.model.layers[0].mlp.down_proj.weight.device.type == "meta"
    bf16 = LLM(dirs["w4"], max_model_len=64, num_kv_blocks=16, dtype="bfloat16").engine.runner.model
    assert set(bf16.quant_kernels.values()) == {"cpu_int4"}
    w8 = LLM(dirs["w8"], max_model_len=64, num_kv_blocks=16, dtype="bfloat16").engine.runner.model
    assert set(w8.quant_kernels.values()) == {"dequantized"}
    assert w8.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16


def test_without_the_native_library_the_default_is_torchs(dirs, monkeypatch):
    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    monkeypatch.setitem(native_ops._state, "lib", None)  # as where no C compiler builds it
    for name, kernel in (("w4", "cpu_int4_bf16"), ("w8", "cpu_int8_bf16")):
        model = LLM(dirs[name], max_model_len=64, num_kv_blocks=16).engine.runner.model
        assert set(model.quant_kernels.values()) == {kernel}


@pytest.mark.parametrize("family", ["default", "bf16"])
@pytest.mark.parametrize("name, reference", [("w4", "w4"), ("w8", "w8"), ("awq", "awq_as_ct")])
def test_float32_default_stays_close_to_the_reference(dirs, monkeypatch, name, reference, family):
    """bf16 activations in the products of a float32 model (the default: the native exact A16 product; `bf16`:
    torch's, whose weights and outputs are bf16 too): over 8 prompts, every top-3 log-probability of the first
    token stays within 0.25 of transformers' float32 on the decompressed checkpoint (measured, torch's: 0.07 int4,
    0.07 int8, 0.13 AWQ; scales off by 10% fail it: 0.27-0.40), and the greedy token is the reference's wherever
    the reference's top two are 0.25 apart."""
    if family == "bf16":
        monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "cpu_int8_bf16" if name == "w8" else "cpu_int4_bf16")
    else:
        monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    prompts = [list(range(3 + i, 40 + 3 * i)) for i in range(8)]
    llm = LLM(dirs[name], max_model_len=128, num_kv_blocks=64)
    assert set(llm.engine.runner.model.quant_kernels.values()) <= {"cpu_int4_bf16", "cpu_int8_bf16", "cpu_int4_a16",
                                                                   "cpu_int8_a16"}
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=1, logprobs=3))
    hf = hf_compressed_tensors(dirs[reference], weight_only=True)
    gaps = []
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
        ours = output.outputs[0].logprobs[0]
        gaps += [abs(entry.logprob - expected[token].item()) for token, entry in ours.items()]
        top2 = expected.topk(2).values
        if top2[0] - top2[1] > 0.25:
            assert output.outputs[0].token_ids[0] == int(expected.argmax())
    print(f"{name} {family}: largest log-prob gap {max(gaps):.3f}")
    assert max(gaps) <= 0.25, max(gaps)


def test_kept_int4_under_bf16_stays_close_to_the_dequantized_model(dirs, monkeypatch):
    """bf16 rounds differently inside torch's int4 product: the first token's log-probabilities stay within
    0.25 of the dequantized bf16 model's (measured: 0.12 at most, bf16's own rounding) over the prompts."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 3 * i))} for i in range(8)]

    def first(kernel):
        monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", kernel)
        outputs = LLM(dirs["w4"], max_model_len=128, num_kv_blocks=64, dtype="bfloat16").generate(prompts, params)
        return [o.outputs[0].logprobs[0] for o in outputs]

    kept, dequantized = first("cpu_int4"), first("dequantized")
    gaps = [abs(a[t].logprob - b[t].logprob) for a, b in zip(kept, dequantized) for t in a if t in b]
    assert gaps and max(gaps) <= 0.25, max(gaps)


def test_start_up_log_counts_the_kept_bytes(dirs, monkeypatch, caplog):
    import logging

    def logged_weights(kernel) -> float:
        monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", kernel)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kubeinfer.engine.core.llm_engine"):
            engine = LLM(dirs["w4"], max_model_len=64, num_kv_blocks=16, dtype="bfloat16").engine
        held = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters() if p.device.type != "meta")
        assert f"weights {held / (1 << 20):.2f} MiB" in caplog.text
        return held

    kept, dequantized = logged_weights("cpu_int4"), logged_weights("dequantized")
    assert f"MiB, {4 * SHAPE['num_layers']} linear layers cpu_int4, KV cache" not in caplog.text  # the last: dequantized
    linear = sum(p.numel() for n, p in LLM(dirs["float"], max_model_len=64, num_kv_blocks=16).engine.runner.model
                 .named_parameters() if ".layers." in n and n.endswith("_proj.weight"))
    # bf16 linear weights (2 bytes each) became half a byte plus a bf16 scale and zero per 32
    assert dequantized - kept == pytest.approx(linear * (2 - 0.5 - 4 / 32), rel=0.01)


@pytest.mark.parametrize("kernel", ["cpu_int4", pytest.param("cpu_int4_a16", marks=NATIVE)])
def test_lora_on_a_kept_int4_base_equals_peft_on_the_decompressed_model(dirs, monkeypatch, tmp_path, kernel):
    """The adapter stays in float beside the int4 product: PEFT over transformers' decompressed load agrees."""
    from lora_helpers import ADAPTERS, make_peft_adapter
    from lora_helpers import PROMPTS as LORA_PROMPTS
    from lora_helpers import hf_greedy as peft_greedy
    from peft import PeftModel

    from kubeinfer.engine.lora.request import LoRARequest

    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", kernel)
    make_peft_adapter(dirs["float"], tmp_path / "adapter", seed=5, **ADAPTERS["all"])
    peft = PeftModel.from_pretrained(hf_compressed_tensors(dirs["w4"], weight_only=True), tmp_path / "adapter").eval()
    expected = [peft_greedy(peft, p) for p in LORA_PROMPTS]
    llm = LLM(dirs["w4"], max_model_len=64, num_kv_blocks=32, enable_lora=True)
    assert set(llm.engine.runner.model.quant_kernels.values()) == {kernel}
    outputs = llm.generate([{"prompt_token_ids": p} for p in LORA_PROMPTS],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")))
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_unknown_kernel_override_is_refused(dirs, monkeypatch):
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "int3")
    with pytest.raises(ValueError, match="KUBEINFER_QUANT_KERNEL must be one of triton, cpu_int4"):
        LLM(dirs["w4"], max_model_len=64, num_kv_blocks=16)
