"""Int8/int4 checkpoint weights kept quantized under tensor parallelism (2 ranks, gloo, on the CPU): each rank
holds its slice of the integers, scales and zeros (column-parallel layers their output rows, row-parallel
ones their input columns, model_executor/int_weights.py), and greedy tokens equal transformers' on the
decompressed checkpoint (`CompressedTensorsConfig(run_compressed=False)`; AWQ through compressed-tensors'
own converter; GPTQ on the float weights its integers mean, as tests/engine/test_quantized_int.py explains).

The kernels are forced (KUBEINFER_QUANT_KERNEL, inherited by the rank processes): torch's int4/int8 CPU
products with float32 activations, exact enough for greedy tokens (tests/engine/test_quantized_kept.py). The
ranks' layers are inspected by loading each rank's slice in this process with the Triton layout (plain int
tensors: int8 values, or two int4 per byte), compared with the one-rank model's."""
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
    gptq_pack,
    hf_compressed_tensors,
    hf_greedy,
    write_checkpoint,
)

from kubeinfer.engine.model_executor.layers.quantization.linear_method import IntWeight

CT = {  # name: (bits, strategy, symmetric, group_size), pack-quantized; the forced kernel
    "w4a16_group_asym": ((4, "group", False, 32), "cpu_int4"),
    "w4a16_group_sym": ((4, "group", True, 64), "cpu_int4"),
    "w4a16_channel_asym": ((4, "channel", False, None), "cpu_int4"),
    "w8a16_channel_sym": ((8, "channel", True, None), "cpu_int8"),
    # no CPU kernel for int8 groups: each rank's int slice is dequantized (the ranks' cut, not the whole's);
    # groups of 128 over o_proj's 128 columns: its 64 a rank are regrouped
    "w8a16_group_asym": ((8, "group", False, 128), None),
}
DEFAULT_SUITE = ("w4a16_group_asym",)
NEAR_TIE = 0.01  # log-probability
LAYERS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    return build_random_model(tmp_path_factory.mktemp("quant_tp") / "float", "llama", tokenizer=False, seed=11,
                              **SHAPE)


def ct_dir(float_dir, name: str) -> str:
    (bits, strategy, symmetric, group), _ = CT[name]
    if (float_dir.parent / name).is_dir():  # written by an earlier test of this module
        return str(float_dir.parent / name)
    config = ct_scheme("pack-quantized", bits, "int", strategy, symmetric, group)
    return write_checkpoint(float_dir, float_dir.parent / name, ct_compress(float_weights(float_dir), config), config)


@pytest.fixture(scope="module")
def awq_dirs(float_dir):
    weights, config = awq_pack(float_weights(float_dir))  # group 128: o_proj's 128 columns, 64 a rank
    return (write_checkpoint(float_dir, float_dir.parent / "awq", weights, config),
            write_checkpoint(float_dir, float_dir.parent / "awq_as_ct", *awq_to_compressed_tensors(weights, config)))


def assert_greedy_equal(got: list[list[int]], hf) -> None:
    """The engine's greedy tokens are the reference model's, except past a near-tie: where a prompt's tokens
    first differ, the reference must rate its own token and the engine's within NEAR_TIE in log-probability
    (tiny random models have flat logits: 0.0014 apart seen at one rank as well; the rest of that prompt
    then follows another path and is not compared). At least half the prompts must agree to the end."""
    from quant_checkpoints import MAX_TOKENS, PROMPTS

    expected = hf_greedy(hf)
    for prompt, mine, theirs in zip(PROMPTS, got, expected):
        assert len(mine) == len(theirs)
        at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if at is None:
            continue
        with torch.no_grad():
            logprobs = hf(torch.tensor([prompt + theirs[:at]])).logits[0, -1].log_softmax(-1)
        gap = float(logprobs[theirs[at]] - logprobs[mine[at]])
        assert gap <= NEAR_TIE, f"prompt {prompt[:4]}...: token {at} is {mine[at]}, the reference's {theirs[at]} " \
                                f"({gap:.4f} more likely): not a near-tie"
    assert sum(a == b for a, b in zip(got, expected)) >= len(MAX_TOKENS) / 2, (got, expected)


def rank_model(model_dir: str, rank: int, size: int):
    """Rank `rank`'s slice of the model as the engine loads it (no process group needed to load)."""
    from kubeinfer.engine.model_executor.layers.attention_selector import get_attention_backend
    from kubeinfer.engine.model_executor.model_loader import inspect_model_dir, load_model

    return load_model(inspect_model_dir(model_dir), get_attention_backend("torch"), 64, torch.device("cpu"),
                      torch.float32, rank, size)


def held(layer) -> dict[str, torch.Tensor]:
    return {n: getattr(layer, n) for n in layer.quant_method.names}


def assert_ranks_hold_halves(model_dir: str, monkeypatch) -> dict:
    """Each rank's kept tensors are the one-rank model's, cut: q/k/v and gate/up by output rows, part by part;
    o_proj and down_proj by input columns (their scales and zeros by group, when the cut is on a group
    boundary). Returns {layer: local group size} of rank 1."""
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "triton")  # the loaded layout only: nothing is multiplied
    whole, ranks = rank_model(model_dir, 0, 1), [rank_model(model_dir, r, 2) for r in (0, 1)]
    spec = [m.spec for m in ranks]
    groups = {}
    for name in LAYERS:
        one = held(whole.model.layers[0].get_submodule(name))
        for rank, model in enumerate(ranks):
            layer = model.model.layers[0].get_submodule(name)
            assert layer.quant_method.kernel == "triton" and layer.weight.device.type == "meta"
            mine = held(layer)
            assert all(not t.is_floating_point() for n, t in mine.items() if n != "weight_scale")
            if name.endswith(("o_proj", "down_proj")):  # input columns: half of them, each rank its own
                packed = one["qweight"].shape[1] // 2  # int4: two columns a byte, the halves still whole bytes
                assert torch.equal(mine["qweight"], one["qweight"][:, rank * packed:(rank + 1) * packed])
                # scales and zeros: the checkpoint group of each of the rank's groups (its own half, on group
                # boundaries; one group's twice where the cut falls inside groups)
                full, local = whole.model.layers[0].get_submodule(name).quant_method.group_size, \
                    layer.quant_method.group_size
                cols = layer.weight.shape[1]
                index = (rank * cols + torch.arange(0, cols, local)) // full
                for key in ("weight_scale", "weight_zero"):
                    assert (key in one) == (key in mine)
                    if key in one:
                        assert torch.equal(mine[key], one[key][:, index]), (name, key)
                groups[name] = local
            else:  # output rows: this rank's q heads, KV heads, gate and up columns
                s = spec[rank]
                sizes = ([s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
                         if "qkv" in name else [s.intermediate_size] * 2)
                for key, tensor in one.items():
                    rows, offset = [], 0
                    for size in sizes:
                        rows.append(tensor[offset + rank * size:offset + (rank + 1) * size])
                        offset += 2 * size
                    assert torch.equal(mine[key], torch.cat(rows)), (name, key)
    return groups


@pytest.mark.parametrize("name", [n if n in DEFAULT_SUITE else pytest.param(n, marks=pytest.mark.slow) for n in CT])
def test_compressed_tensors_two_ranks_keep_their_int_slices(float_dir, monkeypatch, name):
    model_dir = ct_dir(float_dir, name)
    assert_ranks_hold_halves(model_dir, monkeypatch)
    kernel = CT[name][1]
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", kernel or "cpu_int4")  # cpu_int4 does not apply to int8
    assert set(rank_model(model_dir, 1, 2).quant_kernels.values()) == {kernel or "dequantized"}
    assert_greedy_equal(engine_greedy(model_dir, tensor_parallel_size=2), hf_compressed_tensors(model_dir, True))


def test_awq_group_split_inside_a_group_is_regrouped_exactly(awq_dirs, monkeypatch, caplog):
    """AWQ's group of 128 over o_proj's 128 input columns: each rank's 64 columns are half a group, taken
    as one group of 64 with the checkpoint group's scale and zero (IntWeight.narrow); tokens still equal
    the reference's. The start-up log counts rank 0's bytes: its integers, not the float weights."""
    import logging

    awq_dir, reference_dir = awq_dirs
    groups = assert_ranks_hold_halves(awq_dir, monkeypatch)
    assert groups == {"self_attn.o_proj": 64, "mlp.down_proj": 128}
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "cpu_int4")
    rank0 = rank_model(awq_dir, 0, 2)
    assert set(rank0.quant_kernels.values()) == {"cpu_int4"} and len(rank0.quant_kernels) == 4 * SHAPE["num_layers"]
    rank_bytes = sum(p.numel() * p.element_size() for p in rank0.parameters() if p.device.type != "meta")
    linear = lambda model: sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                               if ".layers." in n and "_proj." in n and p.device.type != "meta")
    one_rank = linear(rank_model(awq_dir, 0, 1))
    assert 0.5 * one_rank <= linear(rank0) <= 0.52 * one_rank  # half, plus o_proj's regrouped scales
    with caplog.at_level(logging.INFO, logger="kubeinfer.engine.core.llm_engine"):
        tokens = engine_greedy(awq_dir, tensor_parallel_size=2)
    assert f"weights {rank_bytes / (1 << 20):.2f} MiB, {4 * SHAPE['num_layers']} linear layers cpu_int4 " \
           "(per rank, of 2)" in caplog.text
    assert_greedy_equal(tokens, hf_compressed_tensors(reference_dir, weight_only=True))


@pytest.mark.slow
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_two_ranks_equal_its_float_weights(float_dir, tmp_path, monkeypatch, act_order):
    """Sequential g_idx: kept (o_proj regrouped as AWQ's); act-order g_idx over more than one group (down_proj's
    256 rows): dequantized whole (each row its own group), then cut, as with one rank."""
    from transformers import AutoModelForCausalLM

    weights, config, dense = gptq_pack(float_weights(float_dir), 4, 128, act_order, seed=3)
    model_dir = write_checkpoint(float_dir, tmp_path / "gptq", weights, config)
    if not act_order:
        assert_ranks_hold_halves(model_dir, monkeypatch)
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "cpu_int4")
    kept = rank_model(model_dir, 1, 2).quant_kernels
    assert set(kept.values()) == {"cpu_int4"}  # one group of 128 rows: any order is sequential
    down = {f"model.layers.{i}.mlp.down_proj" for i in range(SHAPE["num_layers"])}  # two groups, permuted
    assert len(kept) == 4 * SHAPE["num_layers"] - (len(down) if act_order else 0)
    assert not (act_order and down & set(kept))
    hf = AutoModelForCausalLM.from_pretrained(write_checkpoint(float_dir, tmp_path / "dense", dense, None),
                                              dtype=torch.float32).eval()
    assert_greedy_equal(engine_greedy(model_dir, tensor_parallel_size=2), hf)


@pytest.mark.slow
def test_lora_on_a_kept_int4_base_over_two_ranks_equals_peft(float_dir, monkeypatch, tmp_path):
    from lora_helpers import ADAPTERS, make_peft_adapter
    from lora_helpers import PROMPTS as LORA_PROMPTS
    from lora_helpers import hf_greedy as peft_greedy
    from peft import PeftModel

    from kubeinfer.engine import LLM, SamplingParams
    from kubeinfer.engine.lora.request import LoRARequest

    model_dir = ct_dir(float_dir, "w4a16_group_asym")
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "cpu_int4")
    make_peft_adapter(float_dir, tmp_path / "adapter", seed=5, **ADAPTERS["all"])
    peft = PeftModel.from_pretrained(hf_compressed_tensors(model_dir, weight_only=True), tmp_path / "adapter").eval()
    expected = [peft_greedy(peft, p) for p in LORA_PROMPTS]
    llm = LLM(model_dir, max_model_len=64, num_kv_blocks=32, enable_lora=True, tensor_parallel_size=2)
    try:
        assert set(llm.engine.runner.model.quant_kernels.values()) == {"cpu_int4"}
        outputs = llm.generate([{"prompt_token_ids": p} for p in LORA_PROMPTS],
                               SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                               lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")))
        assert [o.outputs[0].token_ids for o in outputs] == expected  # (no near-tie met here)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("start, length, group", [(64, 64, 128), (96, 96, 64), (0, 96, 64), (128, 128, 64)])
def test_a_column_slice_dequantizes_to_the_whole_weights_columns(start, length, group):
    """IntWeight.narrow over input columns, on or off group boundaries: the same weights, exactly."""
    gen = torch.Generator().manual_seed(start + length)
    out, cols = 16, 256
    weight = IntWeight(torch.randint(-8, 8, (out, cols), generator=gen).to(torch.int8),
                       torch.rand(out, cols // group, generator=gen), torch.randint(-8, 8, (out, cols // group),
                                                                                    generator=gen).to(torch.int8),
                       group, 4)
    part = weight.narrow(1, start, length)
    assert torch.equal(part.dequantize(), weight.dequantize()[:, start:start + length])
    aligned = start % group == 0 and length % group == 0
    assert part.group_size == group if aligned else group % part.group_size == 0 and part.group_size < group
    assert part.scale.shape[1] == part.zero.shape[1] == -(-length // part.group_size)


@pytest.mark.slow
@pytest.mark.parametrize("family, kv_heads, switches", [("phi3", 2, {}), ("qwen2", 2, {}), ("llama", 1, {}),
                                                       ("llama", 2, {"attention_bias": True, "mlp_bias": True})],
                         ids=["phi3", "qwen2", "llama-kv-replicated", "llama-biases"])
def test_fused_checkpoint_biases_and_replicated_kv_heads_over_two_ranks(tmp_path, monkeypatch, family, kv_heads,
                                                                        switches):
    """Phi-3's checkpoint fuses qkv_proj and gate_up_proj (each rank cuts its parts out of one int tensor);
    column-parallel biases (Qwen2's q/k/v) are cut beside the kept integers and added by the quant method,
    row-parallel ones (o_proj's, down_proj's) once, after the ranks' partial sums; one KV head is held by both
    ranks (the same rows of k and v on each)."""
    from kubeinfer.dev.testing.random_model import build_random_model

    float_dir = build_random_model(tmp_path / "float", family, tokenizer=False, seed=7,
                                   **{**SHAPE, "num_kv_heads": kv_heads}, **switches)
    model_dir = ct_dir(float_dir, "w4a16_group_asym")
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "cpu_int4")
    kept = rank_model(model_dir, 1, 2).quant_kernels
    assert set(kept.values()) == {"cpu_int4"} and len(kept) == 4 * SHAPE["num_layers"]
    assert_greedy_equal(engine_greedy(model_dir, tensor_parallel_size=2), hf_compressed_tensors(model_dir, True))


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq", "biases"])
def test_cuts_on_word_and_group_boundaries_are_read_alone(float_dir, tmp_path, monkeypatch, fmt):
    """Where every cut falls on packed words and groups (groups of 32 over 64-column halves), each rank reads
    its part of the packed tensors from the file: no tensor is unpacked whole (IntWeight.narrow, the cut of a
    whole one, is never called), and the parts are the ones inspected above. With biases on every projection
    (row-parallel ones too), the float biases load beside the kept integers."""
    if fmt == "biases":
        from kubeinfer.dev.testing.random_model import build_random_model

        biased = build_random_model(tmp_path / "float", "llama", tokenizer=False, seed=3, attention_bias=True,
                                    mlp_bias=True, **SHAPE)
        model_dir = ct_dir(biased, "w4a16_group_asym")
    elif fmt == "gptq":
        model_dir = write_checkpoint(float_dir, tmp_path / "gptq", *gptq_pack(float_weights(float_dir), 4, 32)[:2])
    else:
        model_dir = ct_dir(float_dir, "w4a16_group_asym")
    assert_ranks_hold_halves(model_dir, monkeypatch)
    monkeypatch.setattr(IntWeight, "narrow", lambda *args: pytest.fail("a tensor was unpacked whole, then cut"))
    assert len(rank_model(model_dir, 1, 2).quant_kernels) == 4 * SHAPE["num_layers"]
