"""The Triton kernels against torch references, and the engine on the triton backend against transformers.

Without a GPU the kernels run in Triton's CPU interpreter: TRITON_INTERPRET=1 must be set before the
kernel modules are imported, so this module sets it at import when CUDA is absent. Every kernel test
is parametrized over devices: "cpu" (interpreter) and "cuda" (compiled), each skipped where it cannot run.
References are torch's own ops on gathered, contiguous tensors: scaled_dot_product_attention with an
explicit mask, index_copy_, and plain matmuls per token.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install 'kubeinfer[gpu]'): "
                                                         "its kernels are not checked")
DEVICES = [
    pytest.param("cpu", marks=[needs_triton, pytest.mark.skipif(not INTERPRETER, reason="CPU runs need "
                                                                "TRITON_INTERPRET=1 set before triton is imported")]),
    pytest.param("cuda", marks=[needs_triton, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]),
]
DTYPES = [torch.float32, torch.bfloat16]


def tolerance(dtype: torch.dtype) -> dict:
    return dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


# -- KV-cache write -------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_write_kv_cache_scatters_rows_to_their_slots(device, dtype, block_size):
    from kubeinfer.engine.platforms.cuda.triton_attention import write_kv_cache

    torch.manual_seed(0)
    num_blocks, kv_heads, head_dim, tokens = 16, 3, 24, 11  # 3 heads, 24 dims: both padded inside the kernel
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    # k and v as the model has them: column slices of one fused projection (row stride > row width).
    qkv = torch.randn(tokens, 4 * kv_heads * head_dim, device=device).to(dtype)
    k = qkv[:, :kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, 2 * kv_heads * head_dim:3 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:tokens].to(device)
    slots[3] = -1  # padding row: writes nothing
    want_k, want_v = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    want_k.view(-1, kv_heads, head_dim).index_copy_(0, slots[real], k[real])
    want_v.view(-1, kv_heads, head_dim).index_copy_(0, slots[real], v[real])

    write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


# -- paged attention ------------------------------------------------------------------------------
# (query heads, KV heads, head_dim, block_size, sliding window)
SHAPES = {
    "gqa2-block4": (4, 2, 16, 4, None),
    "mha-block1": (2, 2, 16, 1, None),
    "gqa3-block16-dim24": (6, 2, 24, 16, None),  # a group of 3 heads and a head_dim that is no power of two
    "gqa4-block8-window": (8, 2, 16, 8, 6),
}
# (context length after the step, new tokens): decodes first, then a fresh prompt, a chunk after a cached
# prefix spanning several blocks, and a one-token chunk that is not a decode.
SEQUENCES = [(1, 1), (6, 1), (23, 1), (40, 1), (9, 9), (37, 12), (20, 1)]
NUM_DECODES = 4


def new_token_slots(tables: torch.Tensor, block_size: int) -> list[int]:
    """The cache slots of SEQUENCES' new tokens (the last `new` positions of each context)."""
    return [int(tables[i, p // block_size]) * block_size + p % block_size
            for i, (ctx, new) in enumerate(SEQUENCES) for p in range(ctx - new, ctx)]


def make_batch(shape, dtype, device, seed=0):
    heads, kv_heads, head_dim, block_size, window = shape
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in SEQUENCES]
    num_blocks = sum(blocks_per_seq) + 3
    physical = torch.randperm(num_blocks, generator=gen)  # sequences' blocks scattered over the cache
    tables = torch.zeros(len(SEQUENCES), max(blocks_per_seq), dtype=torch.long)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = physical[used:used + n]
        used += n
    starts = [0]
    for _, new in SEQUENCES:
        starts.append(starts[-1] + new)
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    q = torch.randn(starts[-1], heads, head_dim, generator=gen).to(dtype)
    return dict(q=q.to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device), tables=tables.to(device),
                starts=starts, window=window)


def reference_attention(q, k_cache, v_cache, tables, starts, window, scale):
    """Each sequence alone: gather its context contiguously, attend with an explicit causal (+window) mask."""
    out = torch.empty(q.shape, dtype=torch.float64)
    tables = tables.to(k_cache.device)  # the caches may be CPU copies of CUDA ones (the fp8 step's reference)
    for i, (ctx, new) in enumerate(SEQUENCES):
        keys = k_cache[tables[i]].flatten(0, 1)[:ctx].transpose(0, 1).cpu().double()  # [Hkv, ctx, D]
        values = v_cache[tables[i]].flatten(0, 1)[:ctx].transpose(0, 1).cpu().double()
        query = q[starts[i]:starts[i + 1]].transpose(0, 1).cpu().double()  # [H, new, D]
        q_pos = torch.arange(ctx - new, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        mask = k_pos <= q_pos
        if window:
            mask &= k_pos > q_pos - window
        attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[starts[i]:starts[i + 1]] = attended.transpose(0, 1)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", [(16, 16), (None, 64)], ids=["small-tiles", "default-tiles"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_paged_attention_matches_sdpa(shape, tiles, dtype, device):
    from kubeinfer.engine.platforms.cuda.triton_attention import paged_attention

    b = make_batch(shape, dtype, device)
    scale = shape[2] ** -0.5
    query_start = torch.tensor(b["starts"], dtype=torch.int32, device=device)
    context_lens = torch.tensor([ctx for ctx, _ in SEQUENCES], device=device)
    block_m, block_n = tiles
    common = dict(scale=scale, sliding_window=b["window"], block_m=block_m, block_n=block_n)
    args = (b["q"], b["k_cache"], b["v_cache"], b["tables"], query_start, context_lens)
    out = paged_attention(*args, first_seq=0, num_seqs=NUM_DECODES, max_query_len=1, **common)
    paged_attention(*args, first_seq=NUM_DECODES, num_seqs=len(SEQUENCES) - NUM_DECODES,
                    max_query_len=max(new for _, new in SEQUENCES), out=out, **common)

    want = reference_attention(b["q"], b["k_cache"], b["v_cache"], b["tables"], b["starts"], b["window"], scale)
    torch.testing.assert_close(out.cpu().double(), want, **tolerance(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_backend_step_writes_then_attends(device):
    """The backend as the model calls it: new K/V land in the cache, then every query sees them."""
    from kubeinfer.engine.model_executor.layers.attention import AttentionMetadata
    from kubeinfer.engine.model_executor.layers.attention_selector import get_attention_backend

    shape = SHAPES["gqa2-block4"]
    b = make_batch(shape, torch.float32, device, seed=1)
    heads, kv_heads, head_dim, block_size, _ = shape
    backend = get_attention_backend("triton")
    assert backend.name == "triton"
    slots = new_token_slots(b["tables"], block_size)
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(device)
    v = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(device)
    context_lens = [ctx for ctx, _ in SEQUENCES]
    meta = AttentionMetadata.build(slots, b["starts"], context_lens, b["tables"], NUM_DECODES, None, device)
    want_k, want_v = b["k_cache"].clone(), b["v_cache"].clone()
    want_k.view(-1, kv_heads, head_dim)[meta.slot_mapping] = k
    want_v.view(-1, kv_heads, head_dim)[meta.slot_mapping] = v

    out = backend.forward(b["q"], k, v, b["k_cache"], b["v_cache"], meta, head_dim ** -0.5)
    assert torch.equal(b["k_cache"], want_k) and torch.equal(b["v_cache"], want_v)
    want = reference_attention(b["q"], want_k, want_v, b["tables"], b["starts"], None, head_dim ** -0.5)
    torch.testing.assert_close(out.cpu().double(), want, **tolerance(torch.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("q_dtype", "cache_dtype"), [(q, c) for q in DTYPES for c in (torch.float8_e4m3fn,
                                                                                      torch.float8_e5m2)]
                         + [(torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16)])
def test_fp8_cache_step_matches_the_torch_backend(device, q_dtype, cache_dtype):
    """An 8-bit KV cache (--kv-cache-dtype fp8): the kernel stores the bytes torch's saturating cast stores
    (k beyond the type's range included), then attends over the widened cache as SDPA does. A bfloat16 cache
    (--kv-cache-dtype bfloat16) under a float32 or float16 model: likewise, rounded as torch's cast."""
    from kubeinfer.engine.model_executor.layers.attention import AttentionMetadata, write_kv_cache as torch_write
    from kubeinfer.engine.model_executor.layers.attention_selector import get_attention_backend

    shape = SHAPES["gqa2-block4"]
    b = make_batch(shape, torch.float32, device, seed=3)
    heads, kv_heads, head_dim, block_size, _ = shape
    k_cache, v_cache = b["k_cache"].to(cache_dtype), b["v_cache"].to(cache_dtype)
    slots = new_token_slots(b["tables"], block_size)
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(device).to(q_dtype)
    v = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(device).to(q_dtype)
    if cache_dtype.itemsize == 1:
        k[0, 0, 0], v[1, 1, 1] = 1e5, -1e5  # past e4m3's 448 and e5m2's 57344: saturated, not inf or nan
    meta = AttentionMetadata.build(slots, b["starts"], [ctx for ctx, _ in SEQUENCES], b["tables"], NUM_DECODES, None,
                                   device)
    want_k, want_v = k_cache.clone().cpu(), v_cache.clone().cpu()
    torch_write(k.cpu(), v.cpu(), want_k, want_v, meta.slot_mapping.cpu())
    q = b["q"].to(q_dtype)
    out = get_attention_backend("triton").forward(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5)
    assert torch.equal(k_cache.cpu().view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.cpu().view(torch.uint8), want_v.view(torch.uint8))
    assert k_cache.dtype == cache_dtype
    assert torch.isfinite(want_k.float()).all() and torch.isfinite(want_v.float()).all()
    want = reference_attention(q.float(), want_k.float(), want_v.float(), b["tables"], b["starts"], None,
                               head_dim ** -0.5)
    torch.testing.assert_close(out.cpu().double(), want, **tolerance(q_dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bf16_cache_write_rounds_every_magnitude_as_torch(device, dtype):
    """--kv-cache-dtype bfloat16 under a float32 or float16 model: the write kernel's bytes are torch's cast's
    (round to nearest even, carries, subnormals, signed zeros, inf), not the interpreter's truncation."""
    from kubeinfer.engine.platforms.cuda.triton_attention import write_kv_cache

    gen = torch.Generator().manual_seed(6)
    tokens, heads, dim = 256, 2, 64
    k = torch.randn(tokens, heads, dim, generator=gen) * torch.logspace(-42, 38, tokens)[:, None, None]
    k[0, 0, :6] = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 3.3895e38, -0.0, float("inf"), 1.9999])
    k = k.to(dtype)
    caches = [torch.zeros(tokens // 16, 16, heads, dim, dtype=torch.bfloat16, device=device) for _ in range(2)]
    write_kv_cache(k.to(device), (-k).to(device), *caches, torch.arange(tokens, device=device))
    for cache, x in zip(caches, (k, -k)):
        got = cache.cpu().view(tokens, heads, dim)
        assert torch.equal(got.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_write_rounds_every_magnitude_as_torch(device, dtype, cache_dtype):
    """The write kernel's bytes are torch's (clamped) cast's over the 8-bit types' whole range: subnormals, ties,
    carries into the exponent (1.97 -> 2.0), signed zeros, saturation. Triton's own downcast rounds float32
    twice on sm_80 / sm_89 (through float16, truncated), and misrounds carries in the interpreter."""
    from kubeinfer.engine.model_executor.layers.quantization.kv_cache_dtype import to_cache_dtype
    from kubeinfer.engine.platforms.cuda.triton_attention import write_kv_cache

    gen = torch.Generator().manual_seed(5)
    tokens, heads, dim = 256, 2, 64
    top = 3.0 if cache_dtype == torch.float8_e4m3fn else 6.0
    k = torch.randn(tokens, heads, dim, generator=gen) * torch.logspace(-12, top, tokens)[:, None, None]
    k[0, 0, :8] = torch.tensor([1e5, -1e5, 448.0, 464.0, 465.0, -0.0, 1.97, 2.0 ** -10])
    k = k.to(dtype)
    caches = [torch.zeros(tokens // 16, 16, heads, dim, dtype=cache_dtype, device=device) for _ in range(2)]
    write_kv_cache(k.to(device), (-k).to(device), *caches, torch.arange(tokens, device=device))
    for cache, x in zip(caches, (k, -k)):
        assert torch.equal(cache.cpu().view(tokens, heads, dim).view(torch.uint8), to_cache_dtype(x, cache_dtype).view(
            torch.uint8))


# -- batched LoRA shrink / expand ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_spec():
    from transformers import LlamaConfig

    from kubeinfer.engine.config import ModelSpec

    # head_dim 24: the attention width (96) differs from hidden (64), so in/out mix-ups show.
    config = LlamaConfig(hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=24, vocab_size=32)
    return ModelSpec(config, "LlamaForCausalLM")


def random_adapter(spec, lora_id: int, rank: int, modules, seed: int, layers=(0, 1)):
    from kubeinfer.engine.lora.adapter import LoRAAdapter, LoRAWeights, module_shapes

    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(spec)
    weights = {(layer, m): LoRAWeights(torch.randn(rank, shapes[m][0], generator=gen) * 0.3,
                                       torch.randn(shapes[m][1], rank, generator=gen) * 0.3)
               for layer in layers for m in modules}
    return LoRAAdapter(f"adapter{lora_id}", lora_id, rank, 1.0, weights)


# Which slot each of 14 tokens uses (0 = base model): interleaved (gathered rows) and in runs (slices).
ROUTES = {
    "interleaved": [0, 1, 2, 3, 1, 1, 0, 2, 3, 2, 0, 1, 3, 3],
    "runs": [0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0, 0],
    "one-adapter-all-rows": [2] * 14,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("route", ROUTES)
def test_lora_kernels_match_the_torch_path(route, dtype, device, lora_spec):
    from kubeinfer.engine.lora.layers import LoRAContext
    from kubeinfer.engine.lora.pool import LoRAPool
    from kubeinfer.engine.lora.triton_ops import SegmentPlan

    # max rank 32 > one 16-wide rank tile; ranks 4, 20 and 6; adapter 1 targets q and down only, on layer 1 only.
    pool = LoRAPool(lora_spec, max_loras=3, max_lora_rank=32, device=device, dtype=dtype)
    all_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for adapter in (random_adapter(lora_spec, 1, 4, ("q_proj", "down_proj"), seed=1, layers=(1,)),
                    random_adapter(lora_spec, 2, 20, all_modules, seed=2),
                    random_adapter(lora_spec, 3, 6, ("k_proj", "v_proj", "up_proj"), seed=3)):
        pool.add(adapter)
        assert pool.acquire(adapter.id) == adapter.id  # slots 1..3 in order
    rows = ROUTES[route]
    gen = torch.Generator().manual_seed(5)
    for layer in range(lora_spec.num_layers):
        for module in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            torch_ctx = LoRAContext.build(pool, rows)
            torch_ctx.kernel_plan = None  # the torch path, even on CUDA where the kernels are the default
            kernel_ctx = LoRAContext.build(pool, rows)
            kernel_ctx.kernel_plan = SegmentPlan.build(pool, kernel_ctx.groups, kernel_ctx.targets)
            width = sum(w for _, _, w in torch_ctx.parts[module])
            in_features = {"o_proj": 96, "down_proj": 80}.get(module, 64)
            x = torch.randn(len(rows), in_features, generator=gen).to(device=device, dtype=dtype)
            base = torch.randn(len(rows), width, generator=gen).to(device=device, dtype=dtype)
            # The reference in fp32 from the same (rounded) inputs; the torch path itself for fp32.
            want = torch_ctx.apply(base.float().clone(), x.float(), layer, module) if dtype == torch.float32 \
                else _fp32_reference(pool, rows, base, x, layer, module, torch_ctx)
            got = kernel_ctx.apply(base.clone(), x, layer, module)
            torch.testing.assert_close(got.float(), want, **tolerance(dtype), msg=f"layer {layer} {module}")
            base_rows = torch.tensor([s == 0 for s in rows])
            assert torch.equal(got[base_rows], base[base_rows])  # slot-0 tokens are untouched
    # The comparison has teeth: the adapters move the outputs.
    assert (kernel_ctx.delta(x, 1, "down_proj").abs().amax() > 0.1).item()


def _fp32_reference(pool, rows, base, x, layer, module, ctx):
    """base + x @ A.T @ B.T per token, in fp32 from the pool's (rounded) weights."""
    out = base.float().clone()
    for t, slot in enumerate(rows):
        if slot == 0:
            continue
        for name, offset, width in ctx.parts[module]:
            if (layer, name) in pool.slot_targets[slot]:
                a = pool.lora_a[layer][name][slot].float()
                b = pool.lora_b[layer][name][slot].float()
                out[t, offset:offset + width] += (x[t].float() @ a.T) @ b.T
    return out


# -- the engine on the triton backend ------------------------------------------------------------------
PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [40, 41, 42], list(range(60, 90)), list(range(100, 112)) + [5, 6], [7]]
MAX_TOKENS = [6, 8, 4, 6, 7]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_greedy(llm) -> list[list[int]]:
    from kubeinfer.engine import SamplingParams

    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def window_model_dir(tmp_path_factory):
    """A Mistral whose 8-token sliding window is shorter than the prompts, so the window matters."""
    from kubeinfer.dev.testing.random_model import build_random_model

    return str(build_random_model(tmp_path_factory.mktemp("mistral_window"), "mistral", tokenizer=False,
                                  sliding_window=8, seed=11))


@pytest.mark.parametrize("device", DEVICES)
def test_engine_on_triton_matches_transformers(device, model_dirs, hf_models):
    from kubeinfer.engine import LLM

    want = [hf_greedy(hf_models("qwen3"), p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    # 4-token blocks, a 16-token budget (chunked prefill mixed with decodes) and too few blocks (preemption).
    llm = LLM(model_dirs["qwen3"], device=device, dtype="float32", attention_backend="triton", block_size=4,
              num_kv_blocks=14, max_num_batched_tokens=16)
    assert llm.engine.runner.backend.name == "triton"
    model = llm.engine.runner.model
    assert model.model.norm.fused and model.model.rotary.fused  # the fused norm and rotary kernels run too
    assert engine_greedy(llm) == want
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("device", DEVICES)
def test_engine_sliding_window_on_triton_matches_transformers(device, window_model_dir):
    from transformers import AutoModelForCausalLM

    from kubeinfer.engine import LLM

    hf = AutoModelForCausalLM.from_pretrained(window_model_dir, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    llm = LLM(window_model_dir, device=device, dtype="float32", attention_backend="triton", block_size=8,
              num_kv_blocks=64)  # a fixed cache, not 90% of the GPU: GPU tests share one
    assert llm.engine.runner.sliding_window == 8
    assert engine_greedy(llm) == want


@needs_triton
def test_compile_check_covers_every_launched_kernel():
    """Each engine module's launched kernel (`_..._kernel`) has a variant in the compile check: one left out
    never meets ptxas before a GPU does (the fused MoE GEMM and the fp8 decode were missing until 2026-11-27)."""
    import pkgutil

    import kubeinfer.engine as engine
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/
    try:
        from triton_compile_check import variants
    finally:
        sys.path.pop(0)
    launched = set()
    for module in pkgutil.walk_packages(engine.__path__, engine.__name__ + "."):
        if "triton" not in module.name:
            continue
        loaded = importlib.import_module(module.name)
        launched |= {f"{module.name.rsplit('.', 1)[-1]}.{name}" for name, value in vars(loaded).items()
                     if hasattr(value, "arg_names") and name.endswith("_kernel")}  # jitted (or interpreted)
    checked = {f"{kernel.fn.__module__.rsplit('.', 1)[-1]}.{kernel.__name__}" for kernel, *_ in variants()}
    assert launched and launched <= checked, sorted(launched - checked)


@needs_triton
@pytest.mark.slow  # about a minute on 2 cores: ptxas on the kernel variants
def test_kernels_compile_for_gpus_without_one():
    """What the interpreter cannot see: the kernels lower to sm_80 and sm_90 machine code."""
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "triton_compile_check.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, script, "80", "90"], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


# -- backend choice ---------------------------------------------------------------------------------
def test_default_backend_is_triton_on_cuda_and_torch_on_cpu():
    from kubeinfer.engine.config import EngineConfig

    assert EngineConfig(model="m").attention_backend == "torch"
    assert EngineConfig(model="m", device="cuda").attention_backend == ("triton" if HAS_TRITON else "torch")
    assert EngineConfig(model="m", device="cuda", attention_backend="torch").attention_backend == "torch"


def test_unknown_backend_is_refused_with_the_choices():
    from kubeinfer.engine.model_executor.layers.attention_selector import get_attention_backend

    with pytest.raises(ValueError, match="available: torch, triton"):
        get_attention_backend("flash")


@needs_triton
def test_triton_on_cpu_without_interpreter_says_what_to_do():
    code = ("import torch; from kubeinfer.engine.model_executor.layers.attention_selector import check_attention_backend; "
            "check_attention_backend('triton', torch.device('cpu'))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "TRITON_INTERPRET=1" in result.stderr and "--attention-backend torch" in result.stderr


def test_serve_flag_reaches_the_engine_config():
    import argparse

    from kubeinfer.engine.entrypoints.serve import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["model"]).attention_backend is None  # resolved per device by EngineConfig
    assert parser.parse_args(["model", "--attention-backend", "triton"]).attention_backend == "triton"
    with pytest.raises(SystemExit):
        parser.parse_args(["model", "--attention-backend", "flash"])
