"""Whole decoder layers of a CPU decode step in one native call (platforms/cpu/native_decode.py,
platforms/cpu/native/decoder_layer.c).

The reference is the per-module native path (KUBEINFER_CPU_FUSED_LAYERS=0: each norm, product, rotary and the
attention its own C call): the fused layers make the same calls in the same order, so several decode steps'
logits and the KV caches they write must be the same bits, at batch 1, 3 and 16, int8 and int4 weights (llama.cpp's
arithmetic), with and without a qkv bias, sliding windows (every layer's, or one layer's of two), Qwen3's q/k
norms; bfloat16, fp8 e4m3 and e5m2 caches (--kv-cache-dtype), the step's K/V rounded in C as to_cache_dtype
rounds them (checked over every magnitude, both builds); a layer that does not qualify between fused ones. Then
the steps that must not take it: a prefill row in the step, a LoRA step (in the engine too), the native layers
off; and the engine's greedy tokens are the same either way."""
from __future__ import annotations

import pytest
import torch
from quant_checkpoints import SHAPE, ct_compress, ct_scheme, float_weights, write_checkpoint

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.platforms.cpu import cpu_decoder
from kubeinfer.engine.model_executor.layers.attention import AttentionMetadata
from kubeinfer.engine.platforms.cpu.native import ops
from kubeinfer.engine.model_executor.layers.quantization.kv_cache_dtype import to_cache_dtype
from kubeinfer.engine.platforms.cpu import native_decode

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler: the native kernels do not build here")
SCHEMES = {"w4": ("pack-quantized", 4, "int", "group", False, 32), "w4_sym": ("pack-quantized", 4, "int", "group",
                                                                           True, 64),
           "w8": ("pack-quantized", 8, "int", "channel", True, None)}
SCHEMES.update(w4a16=SCHEMES["w4"], w8a16=SCHEMES["w8"])  # the same checkpoints, through the exact A16 product
KERNEL = {"w4": "cpu_int4_vnni", "w4_sym": "cpu_int4_vnni", "w8": "cpu_int8_vnni", "w4a16": "cpu_int4_a16",
          "w8a16": "cpu_int8_a16"}
FAMILIES = {"qwen2": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1,
                          layer_types=["full_attention", "sliding_attention"]),  # qkv bias; one layer windowed
            "mistral": dict(sliding_window=9), "qwen3": {}}  # no bias, every layer windowed; q/k norms
CASES = ["qwen2-w8", "qwen2-w4", "mistral-w8", "mistral-w4", "qwen3-w4_sym", "qwen2-w8a16", "qwen3-w4a16"]
BLOCK = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    root, made = tmp_path_factory.mktemp("decoder"), {}
    for family, extra in FAMILIES.items():
        float_dir = build_random_model(root / family, family, tokenizer=False, seed=5, vocab_size=96,
                                       **SHAPE, **extra)
        made[f"{family}-float"] = float_dir
        for name, scheme in SCHEMES.items():
            if f"{family}-{name}" in CASES:
                config = ct_scheme(*scheme)
                made[f"{family}-{name}"] = write_checkpoint(float_dir, root / f"{family}-{name}",
                                                            ct_compress(float_weights(float_dir), config), config)
    return made


@pytest.fixture
def engine(checkpoints, request, monkeypatch):
    case, lora = request.param.removesuffix("+lora"), request.param.endswith("+lora")
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", KERNEL[case.split("-")[1]])
    llm = LLM(checkpoints[case], max_model_len=128, num_kv_blocks=32, enable_lora=lora)
    yield llm
    llm.shutdown()


def spied(monkeypatch) -> list[int]:
    calls = [0]
    real = cpu_decoder.Layers.run

    def run(self, *args):
        calls[0] += 1
        return real(self, *args)
    monkeypatch.setattr(cpu_decoder.Layers, "run", run)
    return calls


def decode_steps(model, batch: int, steps: int = 3, prefill: int = 0, lora=None, seed: int = 0,
                 cache_dtype: torch.dtype = torch.float32):
    """Logits of `steps` decode steps of `batch` sequences over random caches (of `cache_dtype`) and scattered block
    tables (a prompt of `prefill` tokens after them, when given), each step's tokens the last one's argmax; and the
    caches."""
    gen = torch.Generator().manual_seed(seed)
    spec = model.spec
    lengths = torch.randint(1, 40, (batch,), generator=gen).tolist()
    seqs = lengths + ([prefill] if prefill else [])
    max_blocks = -(-(max(seqs) + steps) // BLOCK)
    tables = torch.randperm(len(seqs) * max_blocks, generator=gen).view(len(seqs), max_blocks)
    caches = [tuple(to_cache_dtype(torch.randn(len(seqs) * max_blocks, BLOCK, spec.num_kv_heads, spec.head_dim,
                                               generator=gen), cache_dtype)
                    for _ in range(2)) for _ in range(spec.num_layers)]
    ids = torch.randint(3, 96, (batch + prefill,), generator=gen)
    out = []
    for _ in range(steps):
        lengths = [n + 1 for n in lengths]
        context = lengths + ([prefill] if prefill else [])
        positions = [n - 1 for n in lengths] + list(range(prefill))
        owners = list(range(batch)) + [batch] * prefill
        slots = [int(tables[s, p // BLOCK]) * BLOCK + p % BLOCK for s, p in zip(owners, positions)]
        starts = list(range(batch + 1)) + ([batch + prefill] if prefill else [])
        meta = AttentionMetadata.build(slots, starts, context, tables, batch, spec.sliding_window,
                                       torch.device("cpu"))
        rows = torch.tensor(list(range(batch)) + ([batch + prefill - 1] if prefill else []))
        with torch.inference_mode(), ops.layers_switch_held():
            logits = model(ids, torch.tensor(positions), caches, meta, rows, lora)
        out.append(logits)
        ids = torch.cat([logits[:batch].argmax(-1), ids[batch:]])
        prefill = 0  # the prompt is in the cache now
    return out, caches


def switch_engine(monkeypatch, engine, variable: str, value: str) -> None:
    """A built engine's switch flipped between steps: its kernel config (the variable only fills the default of
    an engine built after it, kernel_config.py)."""
    field = {"KUBEINFER_CPU_FUSED_LAYERS": "cpu_fused_layers", "KUBEINFER_CPU_NATIVE_LAYERS": "cpu_native_layers"}
    monkeypatch.setattr(engine.engine.runner.kernels, field[variable], value == "1")


def both_ways(model, monkeypatch, **kwargs):
    """{switch: (logits of each step, caches, native runs)} with the fused layers on ("1") and off ("0")."""
    results, calls = {}, spied(monkeypatch)
    for switch in ("1", "0"):
        monkeypatch.setenv("KUBEINFER_CPU_FUSED_LAYERS", switch)
        before = calls[0]
        results[switch] = (*decode_steps(model, **kwargs), calls[0] - before)
    return results


def assert_fused_layers_give_the_per_module_paths_bits(model, monkeypatch, cache_dtype: torch.dtype = torch.float32):
    """Both layers in one native call, and three decode steps' logits and KV caches (of `cache_dtype`) at batch 1, 3
    and 16 the same bits as the per-module path's."""
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", "1")
    steps = native_decode.plan(model)
    assert steps is not None and all(run is not None for _, run in steps) and len(steps) == 1  # both layers, one call
    for batch in (1, 3, 16):
        got = both_ways(model, monkeypatch, batch=batch, cache_dtype=cache_dtype)
        (fused, fused_caches, calls), (ref, ref_caches, ref_calls) = got["1"], got["0"]
        assert calls == 3 and ref_calls == 0, (calls, ref_calls)
        for step, (a, b) in enumerate(zip(fused, ref)):
            assert torch.equal(a, b), f"batch {batch} step {step}: max diff {(a - b).abs().max().item()}"
        for (k, v), (rk, rv) in zip(fused_caches, ref_caches):
            assert k.dtype == cache_dtype and torch.equal(k.view(torch.uint8), rk.view(torch.uint8))
            assert torch.equal(v.view(torch.uint8), rv.view(torch.uint8))


@pytest.mark.parametrize("engine", CASES, indirect=True)
def test_fused_layers_give_the_per_module_paths_bits(engine, monkeypatch):
    assert_fused_layers_give_the_per_module_paths_bits(engine.engine.runner.model, monkeypatch)


@pytest.mark.parametrize(("engine", "cache_dtype"), [("qwen2-w8a16", torch.bfloat16),
                                                    ("qwen3-w4a16", torch.float8_e4m3fn),
                                                    ("mistral-w4", torch.float8_e5m2)], indirect=["engine"])
def test_fused_layers_on_16_and_8_bit_caches_give_the_per_module_paths_bits(engine, cache_dtype, monkeypatch):
    """--kv-cache-dtype bfloat16 / fp8_e4m3 / fp8_e5m2: the fused call writes and reads the same cache bytes."""
    assert_fused_layers_give_the_per_module_paths_bits(engine.engine.runner.model, monkeypatch, cache_dtype)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_k_and_v_round_to_the_cache_as_torch_in_both_builds(cache_dtype, monkeypatch):
    """decoder_layer.c's rounding of K/V against to_cache_dtype (torch's cast, fp8 clamped) over every magnitude
    float32 has: subnormals of each type, ties, carries into the exponent, signed zeros, saturation, inf."""
    import ctypes

    from native_builds import outputs_of_both_builds

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1 << 16, generator=gen) * torch.logspace(-45, 38, 1 << 16)
    bits = torch.randint(0, 0x7F800000, (3, 1 << 12), generator=gen, dtype=torch.int32)  # finite magnitudes
    ties = torch.cat([row >> drop << drop | 1 << (drop - 1) for row, drop in zip(bits, (16, 20, 21))])  # halfway
    ties = torch.cat([ties, ties | -0x80000000])  # bf16's, e4m3's and e5m2's, each sign
    special = torch.tensor([0.0, -0.0, 448.0, 464.0, 465.0, -1e5, 57344.0, 61440.0, 1.97, 2.0 ** -10, 2.0 ** -17,
                            3.4e38, float("inf"), float("-inf")])
    x = torch.cat([x, ties.view(torch.float32), special])
    kind = cpu_decoder.CACHE_TYPES[cache_dtype]

    def rounded():
        out = torch.empty(x.shape, dtype=cache_dtype)
        ops.kernel("ki_round_to_cache", [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p], None)(
            x.data_ptr(), x.numel(), kind, out.data_ptr())
        return out.view(torch.uint8)

    want = to_cache_dtype(x, cache_dtype).view(torch.uint8)
    for got in outputs_of_both_builds(monkeypatch, rounded):
        assert torch.equal(got, want), (got != want).nonzero()[:8]


@pytest.mark.parametrize("engine", ["qwen2-w8"], indirect=True)
@pytest.mark.parametrize("other", [0, 1])
def test_a_layer_it_does_not_take_runs_its_forward_between(engine, monkeypatch, other):
    """One layer of two that does not qualify (gelu: not the C code's silu): it runs per module, the other fused."""
    import torch.nn.functional as F

    model = engine.engine.runner.model
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", "1")
    monkeypatch.setattr(model.model.layers[other].mlp, "activation", F.gelu)
    monkeypatch.delitem(model.__dict__, native_decode.PLAN, raising=False)
    try:
        steps = native_decode.plan(model)
        assert [run is None for _, run in steps] == [i == other for i in range(2)]
        got = both_ways(model, monkeypatch, batch=3)
        assert got["1"][2] == 3 and got["0"][2] == 0
        assert all(torch.equal(a, b) for a, b in zip(got["1"][0], got["0"][0]))
    finally:
        model.__dict__.pop(native_decode.PLAN, None)  # the next test plans again, with silu


@pytest.mark.parametrize("engine", ["qwen2-w4"], indirect=True)
def test_steps_it_does_not_take(engine, monkeypatch):
    model = engine.engine.runner.model
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", "1")
    got = both_ways(model, monkeypatch, batch=3, steps=1, prefill=5)  # decodes and a prompt: per module
    assert got["1"][2] == 0 and all(torch.equal(a, b) for a, b in zip(got["1"][0], got["0"][0]))
    monkeypatch.setenv("KUBEINFER_CPU_FUSED_LAYERS", "1")
    x = torch.zeros(2, model.spec.hidden_size)
    meta = AttentionMetadata.build([0, 1], [0, 1, 2], [1, 1], torch.zeros(2, 1, dtype=torch.long), 2, None,
                                   torch.device("cpu"))
    positions = torch.zeros(2, dtype=torch.long)
    caches = [(torch.zeros(1, BLOCK, model.spec.num_kv_heads, model.spec.head_dim),) * 2] * model.spec.num_layers
    with ops.layers_switch_held():
        assert native_decode.forward_layers(model, x, positions, caches, meta, lora=object()) is None  # LoRA step
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", "0")
    with ops.layers_switch_held():
        assert native_decode.forward_layers(model, x, positions, caches, meta, None) is None
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", "1")
    with ops.layers_switch_held():
        assert native_decode.forward_layers(model, x, positions, caches, meta, None) is not None
    monkeypatch.setenv("KUBEINFER_CPU_FUSED_LAYERS", "2")
    with pytest.raises(ValueError, match="KUBEINFER_CPU_FUSED_LAYERS"), ops.layers_switch_held():
        native_decode.forward_layers(model, x, positions, caches, meta, None)


@pytest.mark.parametrize("engine", ["mistral-w4", "qwen2-w8"], indirect=True)
def test_engine_greedy_tokens_equal_either_way(engine, monkeypatch):
    """Through the engine's own metadata (Qwen2's windowed layer: its own block pool, core/window_blocks.py)."""
    runner = engine.engine.runner
    assert runner.window_pool == (set(runner.spec.layer_windows) == {None, 6})
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 2 * i))} for i in range(4)]
    tokens, calls = {}, spied(monkeypatch)
    for switch in ("1", "0"):
        switch_engine(monkeypatch, engine, "KUBEINFER_CPU_FUSED_LAYERS", switch)
        before = calls[0]
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
        tokens[switch] = [o.outputs[0].token_ids for o in outs]
        assert (calls[0] > before) == (switch == "1")
    assert tokens["1"] == tokens["0"]


def test_checkpoint_kv_scales_keep_the_per_module_path(checkpoints, monkeypatch, tmp_path):
    """An fp8 cache with the checkpoint's k_scale / v_scale (not 1.0): the fused call has no scales, so no layer
    takes it and the steps run per module (ScaledKVBackend applies the scales); the same checkpoint without them
    takes it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kubeinfer.engine.model_executor.layers.quantization.kv_cache_dtype import ScaledKVBackend

    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", KERNEL["w4a16"])
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", "1")
    scaled = tmp_path / "scaled"
    shutil.copytree(checkpoints["qwen3-w4a16"], scaled)
    (file,) = scaled.glob("*.safetensors")
    weights = load_file(str(file))
    for layer in range(SHAPE["num_layers"]):
        weights[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.05)
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.02)
    save_file(weights, str(file), metadata={"format": "pt"})
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 2 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    calls = spied(monkeypatch)
    for name, path in (("plain", checkpoints["qwen3-w4a16"]), ("scaled", scaled)):
        llm = LLM(str(path), max_model_len=128, num_kv_blocks=32, kv_cache_dtype="fp8")
        model = llm.engine.runner.model
        assert all(isinstance(layer.self_attn.backend, ScaledKVBackend) == (name == "scaled")
                   for layer in model.model.layers)
        before = calls[0]
        llm.generate(prompts, params)
        assert (calls[0] > before) == (name == "plain"), name
        llm.shutdown()


@pytest.mark.parametrize("engine", ["qwen2-w4+lora"], indirect=True)
def test_lora_steps_take_the_per_module_path(engine, checkpoints, monkeypatch, tmp_path):
    from lora_helpers import ADAPTERS, make_peft_adapter

    from kubeinfer.engine.lora.request import LoRARequest

    make_peft_adapter(checkpoints["qwen2-float"], tmp_path / "adapter", seed=3, **ADAPTERS["all"])
    adapter = LoRARequest("a", 1, str(tmp_path / "adapter"))
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 2 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens, calls = {}, spied(monkeypatch)
    for switch in ("1", "0"):
        switch_engine(monkeypatch, engine, "KUBEINFER_CPU_FUSED_LAYERS", switch)
        outs = engine.generate(prompts, params, lora_request=adapter)
        tokens[switch] = [o.outputs[0].token_ids for o in outs]
    assert calls[0] == 0 and tokens["1"] == tokens["0"]
    switch_engine(monkeypatch, engine, "KUBEINFER_CPU_FUSED_LAYERS", "1")
    base = engine.generate(prompts, params)  # the same engine, no adapter in the step: fused
    assert calls[0] > 0 and [o.outputs[0].token_ids for o in base] != tokens["1"]


@pytest.mark.parametrize("switch", ["KUBEINFER_CPU_FUSED_LAYERS", "KUBEINFER_CPU_NATIVE_LAYERS"])
def test_a_misspelt_switch_fails_the_start(checkpoints, monkeypatch, switch):
    """Not the first step: an engine that starts serves."""
    monkeypatch.setenv(switch, "yes")
    with pytest.raises(ValueError, match=switch):
        LLM(checkpoints["mistral-float"], max_model_len=64, num_kv_blocks=8)


@pytest.mark.parametrize("engine", ["mistral-w4"], indirect=True)
def test_decode_steps_past_the_context_bound_keep_torch_on_one_thread(engine, monkeypatch):
    """Every layer's attention in C (the fused call, or the per-module path's native attention): a decode step
    over any context is a small step (torch on one thread; on two it spun against the native pool), a prompt's
    step past the bound is not, nor a decode with the native layers off (attention is then torch's)."""
    from kubeinfer.engine.platforms.cpu import cpu_blas

    seen, real = [], cpu_blas.small_step
    monkeypatch.setattr(cpu_blas, "small_step", lambda enabled, *a: seen.append(enabled) or real(enabled, *a))
    monkeypatch.setattr(cpu_blas, "MAX_CONTEXT_TOKENS", 1)  # every step past it
    assert engine.engine.runner.model.openblas_small_steps
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    switches = ((None, True), ("KUBEINFER_CPU_FUSED_LAYERS", True), ("KUBEINFER_CPU_NATIVE_LAYERS", False))
    for switch, decodes in switches:
        if switch:
            switch_engine(monkeypatch, engine, switch, "0")  # the fused layers off, then the native layers as well
        seen.clear()
        engine.generate([{"prompt_token_ids": list(range(10, 16))}] * 2, params)
        assert seen == [False] + [decodes] * 2, switch  # the prompts' step, then two decode steps


@pytest.mark.parametrize("engine", ["mistral-w4"], indirect=True)
def test_a_capped_or_sink_attention_keeps_long_decode_steps_on_torchs_threads(engine, monkeypatch):
    """Scores capped (Gemma 2) or sinks (gpt-oss) run the torch attention: not native, so no small step past the
    bound."""
    from kubeinfer.engine.platforms.cpu import native_decode

    model = engine.engine.runner.model
    monkeypatch.setenv("KUBEINFER_CPU_FUSED_LAYERS", "0")
    model.__dict__.pop("_decode_attention_native", None)
    assert native_decode.decode_attention_native(model)
    for name, value in (("softcap", 30.0), ("sinks", torch.zeros(1))):
        attn = model.model.layers[1].self_attn
        monkeypatch.setattr(attn, name, value, raising=False)
        model.__dict__.pop("_decode_attention_native", None)
        assert not native_decode.decode_attention_native(model), name
        monkeypatch.undo()
        monkeypatch.setenv("KUBEINFER_CPU_FUSED_LAYERS", "0")
    model.__dict__.pop("_decode_attention_native", None)
