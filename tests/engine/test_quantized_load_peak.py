"""A quantized checkpoint's load never allocates the float weights of the layers it keeps quantized
(layers/deferred_weight.py): the peak of the bytes torch holds live during `LLM(...)` (tests/load_peak.py, a
dispatch mode that counts every storage torch's operators create until it is freed) stays near the bytes the
loaded model holds, not the float weights' bytes. Before, `to_empty` allocated every projection in the model
dtype first: the peak over the held bytes was all the float projection weights and more (measured on the
commit before: 1.27-1.77x the float projections' bytes; every case below fails), so a 70B fp8 checkpoint could
not load on one 80 GB GPU. Now it is one layer's integers in transit (measured 0.07-0.22x; bound 0.4). A layer
the kernel choice does not keep gets its float weight on its first float write, and holds it."""
import pytest
import torch
from load_peak import LiveBytes, held_bytes
from quant_checkpoints import ct_compress, ct_scheme, float_weights, triton_on_cpu, write_checkpoint
from test_quantized_fp8 import fp8_config, fp8_quantize

from kubeinfer.engine import LLM
from kubeinfer.engine.platforms.cpu.native import a16_method

# four layers whose projections (4 bytes a weight, 15.7 MB) dwarf the embeddings (0.5 MB) and one layer's transit
SHAPE = dict(hidden_size=256, intermediate_size=1024, num_heads=4, num_kv_heads=2, num_layers=4, vocab_size=256)
TRANSIT = 0.4  # the peak over the held bytes, as a share of the float projections' bytes


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    root = tmp_path_factory.mktemp("load_peak")
    float_dir = build_random_model(root / "float", "llama", tokenizer=False, seed=5, **SHAPE)
    weights = float_weights(float_dir)
    made = {"float": str(float_dir)}
    for name, scheme in (("w4a16", ("pack-quantized", 4, "int", "group", True, 128)),
                         ("w8a16", ("pack-quantized", 8, "int", "channel", True, None))):
        config = ct_scheme(*scheme)
        made[name] = write_checkpoint(float_dir, root / name, ct_compress(weights, config), config)
    made["fp8"] = write_checkpoint(float_dir, root / "fp8", fp8_quantize(weights, [128, 128]), fp8_config([128, 128]))
    return made


def load(model_dir, **kwargs):
    with LiveBytes() as live:
        model = LLM(model_dir, max_model_len=64, num_kv_blocks=16, **kwargs).engine.runner.model
    return model, live.peak


def projection_bytes(model) -> int:
    """The decoder projections' weights in float32 (what `to_empty` used to allocate for them)."""
    return sum(m.weight.numel() * 4 for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and ".layers." in name)


@pytest.mark.parametrize("name, kernel, kwargs", [
    ("w4a16", "cpu_int4_a16" if a16_method.fast() else "cpu_int4_bf16", {}),
    ("w8a16", "cpu_int8_a16" if a16_method.fast() else "cpu_int8_bf16", {}),
    # fp8: kept on CUDA; here through the forced kernel (nothing is multiplied at load)
    pytest.param("fp8", "triton_fp8", {}, marks=triton_on_cpu),
    pytest.param("float", "triton_fp8", {"quantization": "fp8"}, marks=triton_on_cpu),  # one float weight at a time
])
def test_the_load_peak_is_the_kept_bytes_not_the_float_bytes(dirs, monkeypatch, name, kernel, kwargs):
    if kernel == "triton_fp8":
        monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "triton")
    else:
        monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    model, peak = load(dirs[name], **kwargs)
    assert set(model.quant_kernels.values()) == {kernel} and len(model.quant_kernels) == 4 * SHAPE["num_layers"]
    held, floats = held_bytes(model), projection_bytes(model)
    assert held < 0.4 * floats  # kept: one byte or half a byte a weight, and scales
    assert peak - held < TRANSIT * floats, (peak, held, floats)


def test_a_layer_that_falls_back_allocates_its_float_weight_when_written(dirs, monkeypatch):
    """bf16 with int8 weights: dequantized by the kernel choice (measured, linear_method.py), so every
    projection holds its bf16 weight, the checkpoint's dequantized."""
    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    model, _ = load(dirs["w8a16"], dtype="bfloat16")
    assert set(model.quant_kernels.values()) == {"dequantized"}
    layer = model.model.layers[1].mlp.down_proj
    assert layer.weight.device.type == "cpu" and layer.weight.dtype == torch.bfloat16
    dense = float_weights(dirs["float"])["model.layers.1.mlp.down_proj.weight"]
    assert (layer.weight.float() - dense).abs().max() < 0.02 * dense.abs().max()  # int8 per channel, then bf16
    assert held_bytes(model) >= projection_bytes(model) / 2  # bf16: two bytes a weight, allocated
