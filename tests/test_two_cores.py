"""Kept-int products of small steps in two halves on both cores (engine/model_executor/layers/two_cores.py): the
halves give the bits of the whole product (torch's int8 and int4 weight-only kernels), only inside a small step,
a failing half raises in the caller, and a kept-quantized engine's greedy tokens and log-probabilities are the
same with the cut as without it."""
from __future__ import annotations

import pytest
import torch
from quant_checkpoints import SHAPE, ct_compress, ct_scheme, float_weights, write_checkpoint

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.model_executor.layers import cpu_blas, two_cores


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
        with cpu_blas.small_step(True):
            assert two_cores.cut(*parts[0].shape) is not None
            halves = two_cores.product(kernel, tokens, parts, {}, torch.float32)
        assert halves.dtype == torch.float32 and torch.equal(halves, whole.float())


def test_only_small_steps_cut_and_a_failing_half_raises_in_the_caller(split_everything):
    assert two_cores.cut(1024, 1024) is None  # outside a small step: torch's own threads
    with cpu_blas.small_step(True):
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
        assert torch.equal(two_cores.product(kernel, 1, (torch.ones(128, 8),), {}, torch.float32), torch.full((1, 128), 8.0))
    assert two_cores.cut(1024, 1024) is None


@pytest.mark.parametrize("scheme", [("pack-quantized", 8, "int", "channel", True, None),
                                    ("pack-quantized", 4, "int", "group", True, 32)])
def test_engine_outputs_are_the_same_with_and_without_the_cut(tmp_path, monkeypatch, scheme):
    from kubeinfer.testing.random_model import build_random_model

    float_dir = build_random_model(tmp_path / "float", "llama", tokenizer=False, seed=3, **SHAPE)
    config = ct_scheme(*scheme)
    model_dir = write_checkpoint(float_dir, tmp_path / "q", ct_compress(float_weights(float_dir), config), config)
    monkeypatch.setattr(two_cores, "MIN_SPLIT_WEIGHTS", 0)
    cuts = []
    real_cut = two_cores.cut
    monkeypatch.setattr(two_cores, "cut", lambda rows, cols: cuts.append(real_cut(rows, cols)) or cuts[-1])
    prompts = [{"prompt_token_ids": list(range(10 + i, 30 + 3 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    outputs = {}
    for on in (False, True):
        monkeypatch.setattr(two_cores, "ENABLED", on)
        cuts.clear()
        llm = LLM(model_dir, max_model_len=64, num_kv_blocks=32)
        assert set(llm.engine.runner.model.quant_kernels.values()) <= {"cpu_int8_bf16", "cpu_int4_bf16"}
        result = llm.generate(prompts, params)
        llm.shutdown()
        assert any(c is not None for c in cuts) == (on and torch.get_num_threads() > 1)
        outputs[on] = [(c.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs])
                       for r in result for c in r.outputs]
    assert outputs[True] == outputs[False]
