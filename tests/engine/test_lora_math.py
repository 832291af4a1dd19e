"""Batched multi-LoRA building blocks: PEFT adapters load, validate, sit in the device pool, and
base + our batched delta equals PEFT's module output for every row of a mixed batch."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kubeinfer.engine.lora.adapter import (LoRAAdapter, LoRALoadError, LoRAWeights, load_adapter, module_shapes,
                                           resolve_adapter_path)
from kubeinfer.engine.lora.layers import LoRAContext
from kubeinfer.engine.lora.pool import LoRAPool, LoRAPoolError
from lora_helpers import ALL_MODULES, load_hf, make_peft_adapter

# Different ranks, scalings (rsLoRA, per-module rank and alpha), target sets and layers.
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ALL_MODULES),
    "patterns": dict(r=2, lora_alpha=5, target_modules=["k_proj", "o_proj", "gate_proj", "down_proj"],
                     rank_pattern={"down_proj": 6}, alpha_pattern={"o_proj": 3}, layers_to_transform=[1]),
}
IDS = {name: i + 1 for i, name in enumerate(ADAPTERS)}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    # head_dim 24 makes the attention width (96) differ from hidden (64): in/out mix-ups show.
    return build_random_model(tmp_path_factory.mktemp("lora_base"), "llama", tokenizer=False, head_dim=24, seed=7)


@pytest.fixture(scope="module")
def spec(base_dir):
    from transformers import AutoConfig

    from kubeinfer.engine.config import ModelSpec

    return ModelSpec(AutoConfig.from_pretrained(base_dir), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def peft_adapters(base_dir, tmp_path_factory):
    """name -> (saved adapter directory, the PEFT model that is the reference)."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: (root / name, make_peft_adapter(base_dir, root / name, seed=100 + seed, **kwargs))
            for seed, (name, kwargs) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def ours(base_dir):
    from kubeinfer.engine.model_executor.layers.attention_selector import get_attention_backend
    from kubeinfer.engine.model_executor.model_loader import inspect_model_dir, load_model

    return load_model(inspect_model_dir(base_dir), get_attention_backend("torch"), 64, torch.device("cpu"), torch.float32)


def _module(model, layer: int, name: str):
    """A projection of an HF or PEFT llama by its checkpoint name."""
    inner = model.base_model.model.model if hasattr(model, "peft_config") else model.model
    block = inner.layers[layer]
    return getattr(block.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp, name)


PARTS = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "o_proj": ["o_proj"],
         "gate_up_proj": ["gate_proj", "up_proj"], "down_proj": ["down_proj"]}
# Which adapter each of 12 rows uses: interleaved (gathered rows) or in runs (views); None is the base model.
ROUTES = {
    "interleaved": [None, "qv", "all", "patterns", "qv", "qv", None, "all", "patterns", "all", None, "qv"],
    "runs": [None, None, "qv", "qv", "qv", "all", "all", "all", "all", "patterns", "patterns", None],
    "one-adapter": ["all"] * 12,
}


@pytest.mark.parametrize("route", ROUTES)
def test_batched_delta_matches_peft(route, spec, peft_adapters, ours, base_dir):
    pool = LoRAPool(spec, max_loras=3, max_lora_rank=16)  # rank padding beyond every adapter's rank
    for name, (path, _) in peft_adapters.items():
        pool.add(load_adapter(path, spec, max_lora_rank=16, lora_id=IDS[name], name=name))
    slots = {name: pool.acquire(IDS[name]) for name in ADAPTERS}
    rows = ROUTES[route]
    ctx = LoRAContext.build(pool, [slots[n] if n else 0 for n in rows])
    base_model = load_hf(base_dir)
    torch.manual_seed(0)
    for layer in range(spec.num_layers):
        for module, parts in PARTS.items():
            in_features = module_shapes(spec)[parts[0]][0]
            x = torch.randn(len(rows), in_features)
            block = ours.model.layers[layer]
            mine = getattr(block.self_attn if module in ("qkv_proj", "o_proj") else block.mlp, module)
            with torch.no_grad():
                got = ctx.apply(mine(x), x, layer, module)
                refs = {n: torch.cat([_module(m, layer, p)(x) for p in parts], dim=-1)
                        for n, (_, m) in peft_adapters.items()}
                refs[None] = torch.cat([_module(base_model, layer, p)(x) for p in parts], dim=-1)
            want = torch.stack([refs[n][t] for t, n in enumerate(rows)])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"layer {layer} {module} ({route})")
    # The comparison has teeth: the adapters move the outputs.
    delta = ctx.delta(torch.randn(len(rows), spec.hidden_size), 0, "qkv_proj")
    assert delta.abs().max() > 0.1


def test_no_adapter_tokens_skip_lora(spec):
    pool = LoRAPool(spec, max_loras=2, max_lora_rank=4)
    assert LoRAContext.build(pool, [0, 0, 0]) is None
    with pytest.raises(ValueError, match="holds no adapter"):
        LoRAContext.build(pool, [0, 2])


def test_loader_folds_scaling(spec, peft_adapters):
    path, model = peft_adapters["all"]
    adapter = load_adapter(path, spec, max_lora_rank=8, lora_id=5)
    assert (adapter.name, adapter.id, adapter.rank, adapter.target_modules) == ("all", 5, 8, set(ALL_MODULES))
    assert adapter.scaling == pytest.approx(16 / 8 ** 0.5)  # rsLoRA
    peft_q = _module(model, 1, "q_proj")
    torch.testing.assert_close(adapter.weights[(1, "q_proj")].b, peft_q.lora_B["default"].weight * adapter.scaling)


# -- validation ---------------------------------------------------------------------------------------
def _copy(peft_adapters, tmp_path, name="qv"):
    return shutil.copytree(peft_adapters[name][0], tmp_path / "adapter")


def _edit_config(path, **changes):
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def _edit_weights(path, edit):
    file = path / "adapter_model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("change, message", [
    (lambda p: _edit_config(p, target_modules=["q_proj", "v_proj", "lm_head"]), "lm_head"),
    (lambda p: _edit_config(p, use_dora=True), "DoRA"),
    (lambda p: _edit_config(p, bias="lora_only"), "bias"),
    (lambda p: _edit_config(p, modules_to_save=["lm_head"]), "modules_to_save"),
    (lambda p: _edit_config(p, fan_in_fan_out=True), "fan_in_fan_out"),
    (lambda p: _edit_config(p, peft_type="IA3"), "only LoRA"),
    (lambda p: _edit_weights(p, lambda t: t.update({Q_A: t[Q_A][:, :32].contiguous()})), "does not fit this base model"),
    (lambda p: _edit_weights(p, lambda t: t.pop(Q_A.replace("lora_A", "lora_B"))), "no lora_B"),
    (lambda p: _edit_weights(p, lambda t: t.update({Q_A.replace("q_proj", "rotary_emb"): t[Q_A].clone()})), "rotary_emb"),
    (lambda p: _edit_weights(p, lambda t: t.update({Q_A.replace("layers.0", "layers.9"): t[Q_A].clone()})), "2 layers"),
    (lambda p: (p / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
    (lambda p: (p / "adapter_config.json").unlink(), "no adapter_config.json"),
    (lambda p: (p / "adapter_model.safetensors").rename(p / "adapter_model.bin"), "pickle"),
    (lambda p: shutil.rmtree(p), "does not exist"),
], ids=["unknown-target", "dora", "bias", "modules-to-save", "fan-in-fan-out", "not-lora", "wrong-shape",
        "missing-b", "unknown-module-weight", "layer-out-of-range", "missing-weights", "missing-config", "bin-only",
        "missing-dir"])
def test_bad_adapters_are_refused(change, message, spec, peft_adapters, tmp_path):
    path = _copy(peft_adapters, tmp_path)
    load_adapter(path, spec, max_lora_rank=8, lora_id=1)  # the unmodified copy loads
    change(path)
    with pytest.raises(LoRALoadError, match=message):
        load_adapter(path, spec, max_lora_rank=8, lora_id=1)


def test_rank_above_max_lora_rank_is_refused(spec, peft_adapters):
    with pytest.raises(LoRALoadError, match="above max_lora_rank=4.*--max-lora-rank 8"):
        load_adapter(peft_adapters["all"][0], spec, max_lora_rank=4, lora_id=1)


def test_adapter_paths_stay_inside_allowed_roots(tmp_path):
    root, outside = tmp_path / "adapters", tmp_path / "private"
    (root / "good").mkdir(parents=True)
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    assert resolve_adapter_path(root / "good", [root]) == (root / "good").resolve()
    for bad in (root / ".." / "private", root / "escape", outside, "/etc"):
        with pytest.raises(LoRALoadError, match="outside the allowed adapter directories"):
            resolve_adapter_path(bad, [root])
    with pytest.raises(LoRALoadError, match="does not exist"):
        resolve_adapter_path(root / "missing", [root])
    with pytest.raises(LoRALoadError, match="disabled"):
        resolve_adapter_path(root / "good", [])


# -- the pool -------------------------------------------------------------------------------------------
def _fake(spec, lora_id: int, modules=("q_proj",), rank: int = 2) -> LoRAAdapter:
    weights = {}
    for layer in range(spec.num_layers):
        for module in modules:
            in_features, out_features = module_shapes(spec)[module]
            weights[(layer, module)] = LoRAWeights(torch.full((rank, in_features), float(lora_id)),
                                                   torch.full((out_features, rank), float(lora_id)))
    return LoRAAdapter(f"a{lora_id}", lora_id, rank, 1.0, weights)


def test_lru_evicts_idle_adapters_only(spec):
    pool = LoRAPool(spec, max_loras=2, max_lora_rank=4, max_cpu_loras=4)
    for i in (1, 2, 3, 4):
        pool.add(_fake(spec, i))
    s2, s1 = pool.acquire(2), pool.acquire(1)
    assert {s1, s2} == {1, 2} and pool.slot_of(0) == 0
    assert not pool.can_activate(3)  # both slots pinned: the request waits
    with pytest.raises(LoRAPoolError, match="pinned"):
        pool.acquire(3)
    pool.release(1)
    assert pool.can_activate(3) and pool.acquire(3) == s1  # 2 is older but pinned: the idle 1 goes
    assert not pool.is_active(1) and pool.has(1)  # evicted from the device, still in host memory
    with pytest.raises(LoRAPoolError, match="not on the device"):
        pool.slot_of(1)
    pool.release(2)
    pool.release(3)
    pool.acquire(2)
    pool.release(2)  # a later request on 2 makes 3 the least recently used of the idle pair
    assert pool.acquire(4) == pool.slot_of(4) == s1 and not pool.is_active(3)
    assert sorted(pool.active_names()) == ["a2", "a4"] and pool.pinned_names() == ["a4"]
    with pytest.raises(LoRAPoolError, match="in use"):
        pool.remove(4)
    pool.remove(2)
    assert sorted(pool.cached_names()) == ["a1", "a3", "a4"] and pool.can_activate(1)


def test_device_rank_table_follows_slot_reuse(spec):
    """The table the CUDA-graph LoRA kernels read: each slot's rank per (layer, module), 0 where untargeted."""
    pool = LoRAPool(spec, max_loras=1, max_lora_rank=4, max_cpu_loras=2)
    pool.add(_fake(spec, 1, modules=("q_proj", "down_proj"), rank=3))
    pool.add(_fake(spec, 2, modules=("v_proj",), rank=2))

    def column(slot):
        return {key: int(r) for key, r in zip(pool.module_keys, pool.rank_table[:, slot]) if r}

    slot = pool.acquire(1)
    assert column(slot) == {(layer, m): 3 for layer in range(spec.num_layers) for m in ("q_proj", "down_proj")}
    assert not pool.rank_table[:, 0].any()  # slot 0, the base model, never has a rank
    pool.release(1)
    assert pool.acquire(2) == slot  # the same slot, reused: nothing of adapter 1 may remain
    assert column(slot) == {(layer, "v_proj"): 2 for layer in range(spec.num_layers)}


def test_max_cpu_loras_bounds_host_memory(spec):
    loads = []

    def loader(lora_id):
        loads.append(lora_id)
        return _fake(spec, lora_id)

    pool = LoRAPool(spec, max_loras=1, max_lora_rank=4, max_cpu_loras=2, loader=loader)
    pool.add(_fake(spec, 1))
    pool.acquire(1)
    pool.add(_fake(spec, 2))
    pool.add(_fake(spec, 3))  # full: drops 2, the idle one not on the device, and keeps pinned 1
    assert pool.cached_names() == ["a1", "a3"]
    with pytest.raises(LoRAPoolError, match="pinned"):
        pool.acquire(2)  # no slot: refused before reading it, so nothing cached is evicted for it
    assert loads == [] and pool.cached_names() == ["a1", "a3"]
    pool.release(1)
    assert pool.acquire(2) == 1 and loads == [2]  # read back through the loader, 1 evicted from the slot
    assert len(pool.cached_names()) == 2 and not pool.is_active(1)

    pool = LoRAPool(spec, max_loras=1, max_lora_rank=4, max_cpu_loras=2)
    pool.add(_fake(spec, 1))
    pool.acquire(1)
    pool.release(1)
    pool.add(_fake(spec, 2))
    pool.add(_fake(spec, 3))  # 1 is older but on the device: drop 2, which is only in host memory
    assert pool.cached_names() == ["a1", "a3"] and pool.is_active(1)
    with pytest.raises(ValueError, match="at least max_loras"):
        LoRAPool(spec, max_loras=2, max_lora_rank=4, max_cpu_loras=1)


def test_slot_reuse_clears_the_previous_adapter(spec):
    pool = LoRAPool(spec, max_loras=1, max_lora_rank=4)
    pool.add(_fake(spec, 1, modules=("q_proj", "down_proj"), rank=4))
    pool.acquire(1)
    pool.release(1)
    pool.add(_fake(spec, 2, modules=("q_proj", "v_proj"), rank=2))
    assert pool.acquire(2) == 1
    a, b = pool.lora_a[0]["q_proj"][1], pool.lora_b[0]["q_proj"][1]
    assert (a[:2] == 2).all() and (b[:, :2] == 2).all()
    assert a[2:].abs().sum() == 0 and b[:, 2:].abs().sum() == 0  # rank 4 leftovers cleared
    assert pool.lora_a[1]["down_proj"][1].abs().sum() == 0 and pool.lora_b[1]["down_proj"][1].abs().sum() == 0
    assert pool.slot_rank[1] == 2 and pool.lora_a[0]["q_proj"][0].abs().sum() == 0  # slot 0 stays zero
    with pytest.raises(LoRAPoolError, match="not acquired"):
        pool.release(1)
