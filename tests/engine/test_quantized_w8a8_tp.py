"""W8A8 under tensor parallelism (2 ranks, gloo, on the CPU), exact to one rank's numerics
(layers/quantization/w8a8_tp.py): column-parallel layers see each token whole; a row-parallel rank sees its
slice of each token's columns, and per-token dynamic scales take the whole token's range through one MAX
all-reduce of the ranks' ranges.

- The layer: a row-parallel layer over two real ranks quantizes its slice of the input bit for bit as the
  one-rank layer quantizes those columns, and its output equals the one-rank layer's up to float summation
  order; with the ranges' all-reduce removed it does not (the guard).
- The engine: greedy tokens at tensor_parallel_size 2 equal the reference's (transformers with
  `CompressedTensorsConfig()`, and the fp8 references of test_quantized_fp8.py) and the one-rank engine's,
  near ties excused as in test_quantized_w8a8.py (the ranks' partial sums add in another order)."""
import pytest
import torch
import w8a8_tp_ranks
from quant_checkpoints import SHAPE, assert_greedy_equal_but_near_ties, engine_greedy, hf_greedy
from server_harness import free_port
from test_quantized_w8a8 import hf_w8a8, w8a8_checkpoint

from kubeinfer.engine.model_executor.layers.quantization import w8a8_tp
from kubeinfer.engine.model_executor.layers.quantization.errors import QuantizationError


def two_rank_outputs(tmp_path) -> list[dict]:
    torch.multiprocessing.spawn(w8a8_tp_ranks.rank_main, args=(free_port(), str(tmp_path)), nprocs=2)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]


def differing_cases(ranks: list[dict]) -> set[str]:
    """The cases where a rank's quantized columns are not the one-rank layer's bit for bit, or its output is not
    the one-rank layer's up to float summation order."""
    differ = set()
    for name in w8a8_tp_ranks.CASES:
        whole, whole_x = w8a8_tp_ranks.layer_output(name, 0, 1)
        width = w8a8_tp_ranks.IN // 2
        for rank, outputs in enumerate(ranks):
            out, x = outputs[name]
            if x is not None and not torch.equal(x, whole_x[:, rank * width:(rank + 1) * width]):
                differ.add(name)
            if not torch.allclose(out, whole, rtol=1e-5, atol=1e-5 * whole.abs().max().item()):
                differ.add(name)
    return differ


def test_a_row_parallel_layer_over_two_ranks_equals_the_one_rank_layer(tmp_path):
    assert differing_cases(two_rank_outputs(tmp_path)) == set()


def test_without_the_ranges_all_reduce_the_ranks_part_from_the_one_rank_layer(tmp_path, monkeypatch):
    """The guard: each rank's own range (no collective; the spawned ranks read the switch from the
    environment) gives every per-token case other scales (outputs off by ~0.4% of their range), and the
    comparison above fails for each; static and group scales need no collective."""
    monkeypatch.setenv("KUBEINFER_TEST_LOCAL_RANGES", "1")
    per_token = {n for n, (scheme, _) in w8a8_tp_ranks.CASES.items() if scheme.strategy == "token"}
    assert differing_cases(two_rank_outputs(tmp_path)) == per_token


def test_a_rank_cut_inside_an_activation_group_is_refused_by_name():
    from kubeinfer.engine.config import Part
    from kubeinfer.engine.model_executor.layers.linear import RowParallelLinear
    from kubeinfer.engine.model_executor.layers.quantization.activations import ActivationScheme

    group = ActivationScheme("float", "group", True, group_size=128)
    w8a8_tp.check(RowParallelLinear(Part(512, 256, 256), 64, False, 2), group, "o_proj")  # on the boundaries
    w8a8_tp.check(RowParallelLinear(Part(320, 256, 64), 64, False, 2), group, "o_proj")  # the last, partial group
    with pytest.raises(QuantizationError, match=r"o_proj: .* \[64, 128\) of 128, which cut a group of 128"):
        w8a8_tp.check(RowParallelLinear(Part(128, 64, 64), 64, False, 2), group, "o_proj")


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    return build_random_model(tmp_path_factory.mktemp("w8a8_tp") / "float", "qwen3", tokenizer=False, seed=29,
                              **SHAPE)


def rank_model(model_dir: str, rank: int, size: int):
    from kubeinfer.engine.model_executor.layers.attention_selector import get_attention_backend
    from kubeinfer.engine.model_executor.model_loader import inspect_model_dir, load_model

    return load_model(inspect_model_dir(model_dir), get_attention_backend("torch"), 64, torch.device("cpu"),
                      torch.float32, rank, size)


def assert_two_ranks_equal(model_dir: str, reference, **kwargs) -> None:
    """TP=2's greedy tokens against the reference's and the one-rank engine's (near ties excused by the
    reference's own logits)."""
    two = engine_greedy(model_dir, tensor_parallel_size=2, **kwargs)
    assert_greedy_equal_but_near_ties(two, hf_greedy(reference), reference)
    assert_greedy_equal_but_near_ties(two, engine_greedy(model_dir, **kwargs), reference)


@pytest.mark.parametrize("kernel", ["int8_vnni", pytest.param("int_mm", marks=pytest.mark.slow)])
def test_int8_dynamic_per_token_over_two_ranks_equals_the_reference(float_dir, monkeypatch, kernel):
    """compressed-tensors W8A8 int8, dynamic per token: every layer of each rank runs torch._int_mm (or the
    native kernel, its weights packed) on its own int8 slice (q/k/v and gate/up their rows, with this rank's
    rows of the per-channel scales; o_proj and down_proj their input columns)."""
    monkeypatch.setenv("KUBEINFER_W8A8_KERNEL", kernel)
    model_dir = w8a8_checkpoint(float_dir, "int8_dynamic")
    whole = rank_model(model_dir, 0, 1).model.layers[0]
    for rank in (0, 1):
        model = rank_model(model_dir, rank, 2)
        assert set(model.activation_schemes.values()) == {f"int8 dynamic per token ({kernel})"}
        layer = model.model.layers[0]
        half = SHAPE["intermediate_size"] // 2
        gate_up = whole.mlp.gate_up_proj
        rows = torch.cat([gate_up.weight_row_scale[p * 2 * half + rank * half:][:half] for p in (0, 1)])
        assert torch.equal(layer.mlp.gate_up_proj.weight_row_scale, rows)
        if kernel == "int8_vnni":  # the slices' packed weights are checked by the two ranks' tokens below
            continue
        assert torch.equal(layer.mlp.down_proj.qweight_t, whole.mlp.down_proj.qweight_t[rank * half:(rank + 1) * half])
        assert torch.equal(layer.mlp.gate_up_proj.qweight_t,
                           torch.cat([gate_up.qweight_t[:, p * 2 * half + rank * half:][:, :half] for p in (0, 1)], 1))
    assert_two_ranks_equal(model_dir, hf_w8a8(model_dir))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8_dynamic_asym", "fp8_dynamic", "int8_static_asym", "fp8_group"])
def test_compressed_tensors_w8a8_over_two_ranks_equals_the_reference(float_dir, name):
    model_dir = w8a8_checkpoint(float_dir, name)
    assert_two_ranks_equal(model_dir, hf_w8a8(model_dir))


@pytest.mark.slow
def test_fake_quantized_int8_over_two_ranks_equals_the_reference(float_dir, monkeypatch):
    monkeypatch.setenv("KUBEINFER_W8A8_KERNEL", "fake_quant")
    model_dir = w8a8_checkpoint(float_dir, "int8_dynamic")
    assert_two_ranks_equal(model_dir, hf_w8a8(model_dir))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["block", "channel", "flag"])
def test_fp8_over_two_ranks_equals_the_reference(name, tmp_path_factory):
    """The fp8 method: block-wise ([32, 16]: 16-column activation groups, each rank's 32 columns of o_proj
    and down_proj on group boundaries), per channel (`weight_scale`, per-token activations), and
    `--quantization fp8` on the float model (per token), against test_quantized_fp8.py's references (per
    channel: transformers' [1, 64] blocks, one activation group of all 64 columns, i.e. per token)."""
    import test_quantized_fp8 as fp8
    from safetensors.torch import load_file

    from kubeinfer.dev.testing.random_model import build_random_model

    root = tmp_path_factory.mktemp("fp8_tp")
    float_fp8 = build_random_model(root / "float", "qwen3", tokenizer=False, seed=29, **fp8.SHAPE)
    weights = load_file(str(float_fp8 / "model.safetensors"))
    block = [32, 16] if name == "block" else [1, 64]
    quantized = fp8.fp8_quantize(weights, block)
    reference = fp8.write_checkpoint(float_fp8, root / "reference", quantized, fp8.fp8_config(block))
    if name == "channel":  # vLLM's per-channel layout: weight_scale [rows, 1], no weight_block_size
        served = fp8.write_checkpoint(float_fp8, root / name, {k.replace("weight_scale_inv", "weight_scale"): v
                                                               for k, v in quantized.items()}, fp8.fp8_config(None))
    served, kwargs = (str(float_fp8), {"quantization": "fp8"}) if name == "flag" else (
        served if name == "channel" else reference, {})
    assert_two_ranks_equal(served, fp8.hf_fp8(reference), **kwargs)


@pytest.mark.slow
def test_phi3_fused_checkpoint_over_two_ranks_equals_the_reference(tmp_path):
    """Phi-3's checkpoint fuses q/k/v and gate/up in one tensor each: each rank's int_mm layers take their rows
    of the fused per-channel scales at the parts' checkpoint offsets (w8a8_tp.rank_rows)."""
    from kubeinfer.dev.testing.random_model import build_random_model

    phi3 = build_random_model(tmp_path / "float", "phi3", tokenizer=False, seed=7, **SHAPE)
    model_dir = w8a8_checkpoint(phi3, "int8_dynamic")
    assert set(rank_model(model_dir, 1, 2).activation_schemes.values()) <= {"int8 dynamic per token (int_mm)",
                                                                             "int8 dynamic per token (int8_vnni)"}
    assert_two_ranks_equal(model_dir, hf_w8a8(model_dir))
