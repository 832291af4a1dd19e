"""FP8 checkpoints kept as e4m3 in memory (one byte a weight, layers/quantization/fp8.py `int_weight`) and
multiplied through the Triton kernel that decodes e4m3 inside it: the default on CUDA. Here, without a GPU,
the kernel is forced (KUBEINFER_QUANT_KERNEL=triton) and runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1): greedy tokens equal transformers' `FineGrainedFP8Config(dequantize=True)` load with the
format's activation quantization (tests/engine/test_quantized_fp8.py), under tensor parallelism each rank keeps its
slice, `--quantization fp8` on a float checkpoint keeps its per-channel e4m3 weights, and the start-up log's
weight bytes are the bytes held. On the CPU by default fp8 stays dequantized (no fp8 matmul)."""
import logging

import pytest
import torch
from quant_checkpoints import (  # engines shut down
    assert_greedy_equal_but_near_ties,
    engine_greedy,
    hf_greedy,
    triton_on_cpu,
)
from safetensors.torch import load_file
from test_quantized_fp8 import (
    SHAPE,
    assert_fp8_greedy,
    calibrated_activation_scales,
    fp8_config,
    fp8_quantize,
    hf_fp8,
    write_checkpoint,
)

from kubeinfer.engine import LLM
from kubeinfer.engine.model_executor.layers.quantization import fp8, linear_method

LINEAR_LAYERS = 4 * SHAPE["num_layers"]  # qkv, o, gate_up, down


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    root = tmp_path_factory.mktemp("fp8_kept")
    float_dir = build_random_model(root / "float", "qwen3", tokenizer=False, seed=29, **SHAPE)
    weights = load_file(str(float_dir / "model.safetensors"))
    made = {"float": str(float_dir)}
    for name, block in (("block", [32, 64]), ("tensor", None)):
        made[name] = write_checkpoint(float_dir, root / name, fp8_quantize(weights, block), fp8_config(block))
    # Under two ranks o_proj's and down_proj's 64 columns are halved inside a [32, 64] block; dynamic activation
    # groups of 64 could not be cut so (w8a8_tp.py refuses): static activation scales (per tensor) can.
    static = {**fp8_quantize(weights, [32, 64]), **calibrated_activation_scales(float_dir)}
    made["static"] = write_checkpoint(float_dir, root / "static", static,
                                      {**fp8_config([32, 64]), "activation_scheme": "static"})
    return made


def kept_model(model_dir, **kwargs):
    return LLM(model_dir, max_model_len=64, num_kv_blocks=16, **kwargs).engine.runner.model


@triton_on_cpu
@pytest.mark.parametrize("name", ["block", pytest.param("tensor", marks=pytest.mark.slow)])
def test_kept_fp8_greedy_equals_transformers_dequantized(dirs, monkeypatch, name):
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "triton")
    model = kept_model(dirs[name])
    assert set(model.quant_kernels.values()) == {"triton_fp8"} and len(model.quant_kernels) == LINEAR_LAYERS
    layer = model.model.layers[0].mlp.down_proj
    assert layer.weight.device.type == "meta" and layer.qweight.dtype == torch.uint8  # the e4m3 bits, no float copy
    assert layer.quant_method.inner.__self__.fp8  # W8A8: the activations quantized around the kept product
    assert_fp8_greedy(dirs[name])


def test_fp8_stays_dequantized_on_the_cpu_and_is_kept_on_cuda(dirs, monkeypatch):
    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    model = kept_model(dirs["block"])
    assert not model.quant_kernels and model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    values, scale = fp8.quantize_per_channel(torch.randn(32, 64))
    weight = linear_method.IntWeight(values, scale, None, 64, 8, fp8=True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert linear_method.keeps_quantized(cuda, torch.bfloat16, fp8=True)
    assert not linear_method.keeps_quantized(cpu, torch.float32, fp8=True)
    assert linear_method.choose_kernel(weight, cuda, torch.bfloat16) == "triton"
    assert linear_method.choose_kernel(weight, cpu, torch.float32) == "dequantized"
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "dequantized")  # the override: dequantized on CUDA too
    assert not linear_method.keeps_quantized(cuda, torch.bfloat16, fp8=True)
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "cpu_int8")  # no CPU kernel takes fp8
    assert not linear_method.keeps_quantized(cpu, torch.float32, fp8=True)
    assert linear_method.choose_kernel(weight, cpu, torch.float32) == "dequantized"


@triton_on_cpu
def test_start_up_log_counts_the_fp8_bytes(dirs, monkeypatch, caplog):
    def logged_weights(kernel) -> float:
        monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", kernel)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kubeinfer.engine.core.llm_engine"):
            engine = LLM(dirs["block"], max_model_len=64, num_kv_blocks=16).engine
        held = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters() if p.device.type != "meta")
        assert f"weights {held / (1 << 20):.2f} MiB" in caplog.text
        return held, caplog.text

    (kept, text), (dequantized, _) = logged_weights("triton"), logged_weights("dequantized")
    assert f"MiB, {LINEAR_LAYERS} linear layers triton_fp8," in text
    linear = sum(p.numel() for n, p in kept_model(dirs["float"]).named_parameters()
                 if ".layers." in n and n.endswith("_proj.weight"))
    # float32 linear weights (4 bytes) became one byte plus a float32 scale per row and 64 columns
    assert dequantized - kept == pytest.approx(linear * (4 - 1 - 4 / 64), rel=0.01)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=triton_on_cpu), pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))])
def test_quantization_fp8_at_load_keeps_per_channel_e4m3(dirs, monkeypatch, device):
    """--quantization fp8 on a float checkpoint: the projections held as e4m3 with per-row scales, the
    embeddings and lm_head float; tokens equal the dequantized (round-tripped) path's. On CUDA the kernel is
    the default and compiled; on the CPU forced, in Triton's interpreter."""
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "triton")
    model = kept_model(dirs["float"], quantization="fp8", device=device, dtype="float32")
    assert set(model.quant_kernels.values()) == {"triton_fp8"} and len(model.quant_kernels) == LINEAR_LAYERS
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.qweight.dtype == torch.uint8 and tuple(layer.weight_scale.shape) == (layer.qweight.shape[0], 1)
    assert model.lm_head.weight.dtype == torch.float32 and not hasattr(model.lm_head, "qweight")
    held = [t for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta"]
    assert {t.device.type for t in held} == {device}
    kept = engine_greedy(dirs["float"], quantization="fp8", device=device, dtype="float32")
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "dequantized")
    assert kept == engine_greedy(dirs["float"], quantization="fp8", device=device, dtype="float32")


def test_forced_triton_on_a_cpu_engine_needs_the_interpreter(dirs, monkeypatch):
    """Compiled, the Triton kernels take no CPU tensors: on the GPU machine this file's CPU engines (the
    kernel forced, no interpreter there) failed at their first step, "Pointer argument (at 0) cannot be
    accessed from Triton (cpu tensor?)"; now the engine refuses at start-up, naming the ways out."""
    from kubeinfer.engine import triton_utils

    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "triton")
    monkeypatch.setattr(triton_utils, "INTERPRETED", False)  # as where a GPU is: conftest sets it without one
    with pytest.raises(ValueError, match="KUBEINFER_QUANT_KERNEL=triton needs a CUDA device; on the CPU use the "
                                         "CPU's kernels .unset KUBEINFER_QUANT_KERNEL., or set TRITON_INTERPRET=1"):
        kept_model(dirs["float"], quantization="fp8")


def test_two_ranks_keep_their_e4m3_slices(dirs, monkeypatch):
    """Each rank's bits are the one-rank model's, cut, and its weight (bits times scales) the whole weight's
    cut: q/k/v and gate/up by output rows part by part (inside 32-row blocks), o_proj and down_proj by input
    columns, halved inside a 64-column block (regrouped to 32-column groups with the block's scale)."""
    from test_quantized_tp import LAYERS, rank_model

    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "triton")  # the loaded layout only: nothing is multiplied
    whole, ranks = rank_model(dirs["static"], 0, 1), [rank_model(dirs["static"], r, 2) for r in (0, 1)]

    def held(layer):
        method = layer.quant_method.inner.__self__  # under the static activations' method
        assert method.fp8 and layer.weight.device.type == "meta" and layer.qweight.dtype == torch.uint8
        dense = layer.qweight.view(torch.float8_e4m3fn).float() * layer.weight_scale.repeat_interleave(
            method.group_size, 1)[:, :layer.qweight.shape[1]]
        return layer.qweight, dense, method.group_size

    for name in LAYERS:
        bits, dense, _ = held(whole.model.layers[0].get_submodule(name))
        for rank, model in enumerate(ranks):
            mine, mine_dense, group = held(model.model.layers[0].get_submodule(name))
            if name.endswith(("o_proj", "down_proj")):
                assert group == 32  # 64-column blocks cut in halves
                cut = lambda t: t[:, rank * 32:(rank + 1) * 32]
            else:
                s = model.spec
                sizes = ([s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
                         if "qkv" in name else [s.intermediate_size] * 2)
                starts = [sum(2 * z for z in sizes[:i]) + rank * sizes[i] for i in range(len(sizes))]
                cut = lambda t: torch.cat([t[a:a + z] for a, z in zip(starts, sizes)])
            assert torch.equal(mine, cut(bits)) and torch.equal(mine_dense, cut(dense)), (name, rank)


@triton_on_cpu
@pytest.mark.slow
def test_two_ranks_greedy_equals_transformers_dequantized(dirs, monkeypatch):
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "triton")
    reference = hf_fp8(dirs["static"])  # the same prompts as test_quantized_fp8's; the ranks end with the engine
    assert_greedy_equal_but_near_ties(engine_greedy(dirs["static"], tensor_parallel_size=2), hf_greedy(reference),
                                      reference)


@triton_on_cpu
@pytest.mark.parametrize("name", ["fp8_static", pytest.param("fp8_group", marks=pytest.mark.slow)])
def test_compressed_tensors_float_quantized_kept(dirs, monkeypatch, name):
    """compressed-tensors `float-quantized` (FP8 W8A8, per-channel e4m3 weights) kept through the kernel: greedy
    tokens equal transformers' compressed-tensors load with its activation quantization."""
    from pathlib import Path

    from test_quantized_w8a8 import hf_w8a8, w8a8_checkpoint

    model_dir = w8a8_checkpoint(Path(dirs["float"]), name)
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "triton")
    model = kept_model(model_dir)
    assert set(model.quant_kernels.values()) == {"triton_fp8"} and len(model.quant_kernels) == LINEAR_LAYERS
    assert model.model.layers[0].mlp.down_proj.qweight.dtype == torch.uint8
    reference = hf_w8a8(model_dir)
    assert_greedy_equal_but_near_ties(engine_greedy(model_dir), hf_greedy(reference), reference)
    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL")  # the CPU's default: dequantized
    assert not kept_model(model_dir).quant_kernels
