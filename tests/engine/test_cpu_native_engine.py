"""The native kernels inside the engine: KUBEINFER_QUANT_KERNEL=cpu_int8_vnni / cpu_int4_vnni (opt-in: llama.cpp's
arithmetic for weight-only checkpoints) keeps the weights packed, one byte / half a byte each; a layer's output
is the gguf-Q8_0 reference's on transformers' decompression of the checkpoint, and the model's log-probabilities
are transformers' on it with each projection's input through gguf's Q8_0. Without the library (no C compiler)
the engine falls back to torch's kernels, W8A8 included."""
from __future__ import annotations

import pytest
import torch
from quant_checkpoints import SHAPE, ct_compress, ct_scheme, float_weights, hf_compressed_tensors, write_checkpoint
from test_cpu_native_kernels import gguf_reference

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.platforms.cpu.native import ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler: the native kernels do not build here")
SCHEMES = {"w4": ("pack-quantized", 4, "int", "group", False, 32),  # asymmetric int4, groups of 32
           "w4_sym": ("pack-quantized", 4, "int", "group", True, 64),
           "w8": ("pack-quantized", 8, "int", "channel", True, None)}
KERNEL = {"w4": "cpu_int4_vnni", "w4_sym": "cpu_int4_vnni", "w8": "cpu_int8_vnni"}


def q8_0_fake_quantize(x: torch.Tensor) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    blocks = quants.quantize(x.float().numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(x.shape)).to(x.dtype)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    root = tmp_path_factory.mktemp("native")
    float_dir = build_random_model(root / "float", "llama", tokenizer=False, seed=11, **SHAPE)
    made = {}
    for name, scheme in SCHEMES.items():
        config = ct_scheme(*scheme)
        made[name] = write_checkpoint(float_dir, root / name, ct_compress(float_weights(float_dir), config), config)
    return made


@pytest.mark.parametrize("name", list(SCHEMES))
def test_llama_cpp_arithmetic_in_the_engine(dirs, monkeypatch, name):
    kernel = KERNEL[name]
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", kernel)
    llm = LLM(dirs[name], max_model_len=128, num_kv_blocks=64)
    model = llm.engine.runner.model
    assert set(model.quant_kernels.values()) == {kernel} and len(model.quant_kernels) == 4 * SHAPE["num_layers"]
    down = model.model.layers[0].mlp.down_proj
    out_f, in_f = down.weight.shape
    assert down.weight.device.type == "meta" and down.qweight.dtype == torch.uint8
    assert down.qweight.numel() == out_f * in_f // (1 if kernel == "cpu_int8_vnni" else 2)  # no padding here
    # layers (q/k/v fused) against gguf's Q8_0 activations times transformers' decompressed weight, float64
    hf = hf_compressed_tensors(dirs[name], weight_only=True)
    ours, theirs = model.model.layers[0], hf.model.layers[0]
    attention = theirs.self_attn
    for layer, weight in ((down, theirs.mlp.down_proj.weight),
                          (ours.self_attn.qkv_proj, torch.cat([attention.q_proj.weight, attention.k_proj.weight,
                                                               attention.v_proj.weight]))):
        x = torch.randn(5, layer.weight.shape[1], generator=torch.Generator().manual_seed(1))
        expected = gguf_reference(x, weight.detach().float())
        with torch.inference_mode():
            got = layer(x).double()
        assert (got - expected).abs().max() <= 2e-6 * expected.abs().max()
    # the whole model against transformers' on the decompressed checkpoint with every decoder projection's input
    # quantized-dequantized by gguf's Q8_0 (llama.cpp's arithmetic, up to float sums), first-token log-probs per
    # prompt. Measured: 3e-6 at most, but one prompt of six at 0.035 (w4_sym): the two sides' inputs to a
    # projection differ by float rounding, and a value that lands on the other side of a Q8_0 rounding step
    # moves by a whole step. The guard: the reference without the activation quantization is 0.30-0.43 away.
    prompts = [list(range(3 + i, 40 + 3 * i)) for i in range(6)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=1, logprobs=3))
    gaps = {}
    for hooked in (False, True):
        for prompt, output in zip(prompts, outputs):
            with torch.inference_mode():
                ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
            gaps.setdefault(hooked, []).append(max(abs(e.logprob - ref[t].item())
                                                   for t, e in output.outputs[0].logprobs[0].items()))
        for module in hf.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _, args: (q8_0_fake_quantize(args[0]),))
    assert sorted(gaps[True])[-2] <= 1e-4 and max(gaps[True]) <= 0.1, gaps[True]
    assert max(gaps[False]) > 0.2, gaps[False]
    llm.shutdown()


def test_without_the_library_torch_kernels_serve(dirs, monkeypatch):
    """No C compiler: the opt-in kernel falls back to torch's bf16-activation product of the same width."""
    monkeypatch.setitem(ops._state, "lib", None)
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "cpu_int8_vnni")
    llm = LLM(dirs["w8"], max_model_len=64, num_kv_blocks=16)
    assert set(llm.engine.runner.model.quant_kernels.values()) == {"cpu_int8_bf16"}
    llm.shutdown()


def test_without_the_library_w8a8_runs_int_mm(tmp_path, monkeypatch):
    from test_quantized_w8a8 import w8a8_checkpoint

    from kubeinfer.dev.testing.random_model import build_random_model

    monkeypatch.setitem(ops._state, "lib", None)
    monkeypatch.delenv("KUBEINFER_W8A8_KERNEL", raising=False)
    float_dir = build_random_model(tmp_path / "float", "llama", tokenizer=False, seed=3, **SHAPE)
    llm = LLM(w8a8_checkpoint(float_dir, "int8_dynamic"), max_model_len=64, num_kv_blocks=16)
    assert set(llm.engine.runner.model.activation_schemes.values()) == {"int8 dynamic per token (int_mm)"}
    llm.shutdown()
