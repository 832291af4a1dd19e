"""The CPU path through OpenBLAS (kubeinfer/engine/platforms/cpu/cpu_blas.py): the same products as torch's
`F.linear`, only inside small steps (decodes, drafts, short chunks) and not over long contexts, with
torch on one thread there and its threads given back after (also when the step raises);
`KUBEINFER_CPU_OPENBLAS=0` keeps torch's matmuls. Greedy outputs against transformers with this path on
are in test_engine_correctness."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.platforms.cpu import cpu_blas
from kubeinfer.engine.platforms.cpu.native import f32_ops, ops


def test_products_equal_torch_linear_with_and_without_bias_and_for_strided_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96, bias=True), nn.Linear(96, 32, bias=False))
    assert cpu_blas.use_openblas_for_small_steps(model)
    with torch.inference_mode():
        for x in (torch.randn(1, 48), torch.randn(5, 48), torch.randn(48, 7).t()):  # the last is not contiguous
            expected = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight)
            with cpu_blas.small_step(True):
                got = model(x)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_only_small_steps_use_openblas_and_torch_threads_come_back(monkeypatch):
    calls = []
    real = np.matmul
    monkeypatch.setattr(cpu_blas.np, "matmul", lambda a, b: calls.append(a.shape) or real(a, b))
    layer = nn.Linear(8, 8)
    cpu_blas.use_openblas_for_small_steps(layer)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        layer(torch.randn(1, 8))
        assert calls == []  # outside a small step: torch's matmul
        with pytest.raises(RuntimeError), cpu_blas.small_step(True):
            assert torch.get_num_threads() == 1
            layer(torch.randn(1, 8))
            raise RuntimeError("a step that fails")
    assert calls == [(1, 8)] and torch.get_num_threads() == threads


def test_a_small_step_on_one_thread_leaves_another_threads_torch_alone():
    """Two engines stepping on two threads of one process: torch's thread count and the OpenBLAS switch
    are per thread, so one engine's small step does not change the other's prefill."""
    import threading

    threads = torch.get_num_threads()
    inside, checked = threading.Event(), threading.Event()

    def step_elsewhere():
        with cpu_blas.small_step(True):
            inside.set()
            checked.wait(5)

    worker = threading.Thread(target=step_elsewhere)
    worker.start()
    inside.wait(5)
    try:
        assert torch.get_num_threads() == threads and not getattr(cpu_blas._step, "active", False)
    finally:
        checked.set()
        worker.join(5)
    assert torch.get_num_threads() == threads


def test_the_engine_decodes_through_openblas_and_prefills_through_torch(llama_dir, monkeypatch):
    """Small steps (here at most 4 tokens) go through OpenBLAS, those of 2-16 tokens through the native float32
    product where it builds; the prompts' prefill step through torch."""
    seen, native = [], []
    real, real_native = np.matmul, f32_ops.f32_linear
    monkeypatch.setattr(cpu_blas.np, "matmul", lambda a, b: seen.append(a.shape[0]) or real(a, b))
    monkeypatch.setattr(f32_ops, "f32_linear", lambda x, w, *a: native.append(x.shape[0]) or real_native(x, w, *a))
    monkeypatch.setattr(cpu_blas, "MAX_STEP_TOKENS", 4)
    llm = LLM(llama_dir, block_size=4)
    assert llm.engine.runner.model.openblas_small_steps
    prompt = {"prompt_token_ids": list(range(10, 30))}
    llm.generate([prompt] * 2, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 2)])
    assert seen and set(seen + native) <= {1, 2}  # decode rows only: the 40 prompt tokens went through torch
    if ops.layers_enabled():  # the one-row steps' projections through OpenBLAS, the two-row steps' native
        assert set(seen) == {1} and 2 in native


def test_steps_over_a_long_context_keep_torch(llama_dir, monkeypatch):
    """Torch's attention over much context needs torch's threads: past the bound, steps stay in torch (with the
    native layers on, decode attention runs in C and such steps stay small: test_cpu_native_decoder)."""
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", "0")
    seen = []
    real = np.matmul
    monkeypatch.setattr(cpu_blas.np, "matmul", lambda a, b: seen.append(a.shape[0]) or real(a, b))
    monkeypatch.setattr(cpu_blas, "MAX_CONTEXT_TOKENS", 21)  # the first decode step's context, no more
    monkeypatch.setattr(cpu_blas, "MAX_STEP_TOKENS", 4)  # and the prompt's step through torch
    llm = LLM(llama_dir, block_size=4)
    llm.generate([{"prompt_token_ids": list(range(10, 30))}], SamplingParams(temperature=0, max_tokens=4))
    projections = sum(isinstance(m, nn.Linear) for m in llm.engine.runner.model.modules())
    assert seen == [1] * projections  # the first decode step's, not the three after it


def test_the_switch_keeps_torch_matmuls(llama_dir, monkeypatch):
    monkeypatch.setenv("KUBEINFER_CPU_OPENBLAS", "0")
    assert not LLM(llama_dir, block_size=4).engine.runner.model.openblas_small_steps
