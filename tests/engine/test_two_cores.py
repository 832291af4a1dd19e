"""Kept-int products of small steps in two halves on both cores (kubeinfer/engine/platforms/cpu/two_cores.py):
the halves give the bits of the whole product (torch's int8 and int4 weight-only kernels), only inside a small step,
a failing half raises in the caller; decode attention in two halves of the sequences gives the bits of the whole;
and an engine's greedy tokens and log-probabilities (float32, kept int8 and int4) are the same with the halves as
without them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from quant_checkpoints import SHAPE, ct_compress, ct_scheme, float_weights, write_checkpoint
from test_triton_kernels import NUM_DECODES, SEQUENCES, SHAPES, make_batch, new_token_slots

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.platforms.cpu import cpu_blas, two_cores


def int8_product(rows):
    return lambda w, s: torch.ops.aten._weight_int8pack_mm(rows, w, s)


def int4_product(rows, group):
    return lambda w, sz: torch.ops.aten._weight_int4pack_mm_for_cpu(rows, w, group, sz)


@pytest.fixture
def split_everything(monkeypatch):
    monkeypatch.setattr(two_cores, "MIN_SPLIT_WEIGHTS", 0)
    monkeypatch.setattr(two_cores, "ENABLED", True)


@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize("out_rows", [256, 448, 1024])
def test_halves_give_the_bits_of_the_whole_product(split_everything, tokens, out_rows):
    torch.manual_seed(out_rows + tokens)
    cols, group = 512, 128
    x = torch.randn(tokens, cols).bfloat16()
    int8 = (torch.randint(-127, 128, (out_rows, cols), dtype=torch.int8), torch.rand(out_rows).bfloat16())
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (out_rows, cols),
                                                                              dtype=torch.int32), 1)
    int4 = (packed, torch.rand(cols // group, out_rows, 2).bfloat16())
    for kernel, parts in ((int8_product(x), int8), (int4_product(x, group), int4)):
        whole = kernel(*parts)
        with cpu_blas.small_step(True, share_cores=True):
            assert two_cores.cut(*parts[0].shape) is not None
            halves = two_cores.product(kernel, tokens, parts, {}, torch.float32)
        assert halves.dtype == torch.float32 and torch.equal(halves, whole.float())


def test_only_small_steps_cut_and_a_failing_half_raises_in_the_caller(split_everything):
    assert two_cores.cut(1024, 1024) is None  # outside a small step: torch's own threads
    with cpu_blas.small_step(True, share_cores=True):
        assert two_cores.cut(1024, 1024) == 512
        assert two_cores.cut(100, 1024) is None  # no cut at a multiple of 64 rows

        def kernel(w):  # the second half fails, whichever thread computes it
            if w[0, 0] == 2:
                raise ValueError("a half that fails")
            return w.float().sum(1)[None]
        weight = torch.cat([torch.ones(64, 8), torch.full((64, 8), 2.0)])
        for _ in range(20):
            with pytest.raises(ValueError, match="a half that fails"):
                two_cores.product(kernel, 1, (weight,), {}, torch.float32)
        whole = two_cores.product(kernel, 1, (torch.ones(128, 8),), {}, torch.float32)
        assert torch.equal(whole, torch.full((1, 128), 8.0))
    assert two_cores.cut(1024, 1024) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_decode_attention_in_halves_gives_the_bits_of_the_whole(shape, dtype, monkeypatch):
    """Ragged and equal lengths (masked and unmasked SDPA), GQA groups, a window; bf16 takes _grouped_decode. Both
    on one torch thread, as in a small step (with more, torch's CPU SDPA splits the keys by batch and thread count)."""
    from kubeinfer.engine.model_executor.layers.attention import AttentionMetadata
    from kubeinfer.engine.model_executor.layers.attention_selector import get_attention_backend

    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", "0")  # the torch path's split (the native kernel has its pool)
    calls = []
    real_both = two_cores.both
    monkeypatch.setattr(two_cores, "both", lambda a, b: calls.append(1) or real_both(a, b))
    heads, kv_heads, head_dim, block_size, window = shape
    b = make_batch(shape, dtype, "cpu", seed=5)
    decodes = [ctx for ctx, _ in SEQUENCES[:NUM_DECODES]]
    for lengths in (decodes, [max(decodes)] * NUM_DECODES):
        slots = new_token_slots(b["tables"], block_size)[:NUM_DECODES]
        k = torch.randn(NUM_DECODES, kv_heads, head_dim).to(dtype)
        v = torch.randn(NUM_DECODES, kv_heads, head_dim).to(dtype)
        outs = []
        for on in (False, True):
            meta = AttentionMetadata.build(slots, list(range(NUM_DECODES + 1)), lengths, b["tables"][:NUM_DECODES],
                                           NUM_DECODES, window, torch.device("cpu"))
            monkeypatch.setattr(two_cores, "ENABLED", on)
            with cpu_blas.small_step(True, share_cores=True):  # torch on one thread, as in the engine's small steps
                outs.append(get_attention_backend("torch").forward(b["q"][:NUM_DECODES], k, v, b["k_cache"],
                                                                   b["v_cache"], meta, head_dim ** -0.5))
        assert torch.equal(outs[0], outs[1])
    assert len(calls) == (2 if torch.get_num_threads() > 1 else 0)  # one split per sharing call


@pytest.mark.parametrize("scheme", [None, ("pack-quantized", 8, "int", "channel", True, None),
                                    ("pack-quantized", 4, "int", "group", True, 32)])
def test_engine_outputs_are_the_same_with_and_without_the_cut(tmp_path, monkeypatch, scheme):
    """Kept int8 / int4: products and attention in halves, the same outputs; float32: nothing shared (its
    projections go through OpenBLAS, whose spinning worker the helper would compete with)."""
    from kubeinfer.dev.testing.random_model import build_random_model

    float_dir = build_random_model(tmp_path / "float", "llama", tokenizer=False, seed=3, **SHAPE)
    model_dir = float_dir
    if scheme is not None:  # torch's products (the default where the native A16 product does not build)
        monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", f"cpu_int{scheme[1]}_bf16")
        config = ct_scheme(*scheme)
        model_dir = write_checkpoint(float_dir, tmp_path / "q", ct_compress(float_weights(float_dir), config), config)
    monkeypatch.setattr(two_cores, "MIN_SPLIT_WEIGHTS", 0)
    cuts = []
    real_cut = two_cores.cut
    monkeypatch.setattr(two_cores, "cut", lambda rows, cols: cuts.append(real_cut(rows, cols)) or cuts[-1])
    halves = []
    real_both = two_cores.both
    monkeypatch.setattr(two_cores, "both", lambda a, b: halves.append(1) or real_both(a, b))
    prompts = [{"prompt_token_ids": list(range(10 + i, 30 + 3 * i))} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    outputs = {}
    for on in (False, True):
        monkeypatch.setattr(two_cores, "ENABLED", on)
        cuts.clear()
        llm = LLM(model_dir, max_model_len=64, num_kv_blocks=32)
        kernels = set(getattr(llm.engine.runner.model, "quant_kernels", {}).values())
        assert kernels <= {"cpu_int8_bf16", "cpu_int4_bf16"} and bool(kernels) == (scheme is not None)
        result = llm.generate(prompts, params)
        llm.shutdown()
        shared = on and torch.get_num_threads() > 1 and scheme is not None  # float32 models do not share
        assert any(c is not None for c in cuts) == shared
        assert bool(halves) == shared
        halves.clear()
        outputs[on] = [(c.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs])
                       for r in result for c in r.outputs]
    assert outputs[True] == outputs[False]


def test_the_switch_reads_auto_0_and_1_and_refuses_others(monkeypatch):
    monkeypatch.delenv("KUBEINFER_CPU_SHARE_CORES", raising=False)
    for timeout, on in ((None, False), ("28", False), ("4", True), ("10", True)):
        if timeout is None:
            monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
        else:
            monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", timeout)
        assert two_cores._enabled() is on
    for forced, on in (("1", True), ("0", False)):
        monkeypatch.setenv("KUBEINFER_CPU_SHARE_CORES", forced)
        assert two_cores._enabled() is on
    monkeypatch.setenv("KUBEINFER_CPU_SHARE_CORES", "yes")
    with pytest.raises(ValueError, match="auto, 0 or 1"):
        two_cores._enabled()


@pytest.mark.parametrize("preset, expected", [(None, "4"), ("7", "7")])
def test_the_kubeinfer_command_sets_openblas_thread_timeout_before_numpy_loads(preset, expected):
    """OpenBLAS reads OPENBLAS_THREAD_TIMEOUT when numpy loads it: the command sets it first (auto sharing needs
    it <= 10), and keeps a value the user set."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if preset is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = preset
    probe = ("import sys, os, kubeinfer.cli; assert 'numpy' not in sys.modules; "
             "print(os.environ['OPENBLAS_THREAD_TIMEOUT'])")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected
