"""Qwen3-MoE, Qwen2-MoE and Mixtral: greedy outputs token-for-token equal to transformers' (its eager experts,
one expert at a time) on tiny random models (8 experts, top-2, random routers), in mixed batches with the
prefix cache on, and under forced preemption with chunked prefill. The experts load into stacked tensors from
either checkpoint layout (one tensor per expert, the Hub's; or already stacked)."""
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_correctness import MAX_TOKENS, PROMPTS, hf_greedy

from kubeinfer.engine import LLM, SamplingParams

# family -> its tiny model's switches: Qwen3-MoE with a dense layer between sparse ones, Qwen2-MoE with its
# shared expert and without renormalisation, Mixtral.
VARIANTS = {
    "qwen3_moe": dict(num_layers=3, mlp_only_layers=[1]),
    "qwen2_moe": dict(num_layers=2),
    "mixtral": dict(num_layers=2),
}


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.set_experts_implementation("eager")
    return model


def hf_references(model_dir, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    model = hf_model(model_dir)
    return [hf_greedy(model, p, n) for p, n in zip(prompts, max_tokens)]


def run(llm: LLM, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    root = tmp_path_factory.mktemp("moe")
    return {family: str(build_random_model(root / family, family, tokenizer=False, seed=40 + i, **variant))
            for i, (family, variant) in enumerate(VARIANTS.items())}


@pytest.fixture(scope="module")
def references(moe_dirs):
    cache = {}

    def get(family: str) -> list[list[int]]:
        if family not in cache:
            cache[family] = hf_references(moe_dirs[family])
        return cache[family]
    return get


@pytest.mark.parametrize("family", VARIANTS)
def test_greedy_batch_matches_transformers(family, moe_dirs, references):
    llm = LLM(moe_dirs[family], block_size=4, enable_prefix_caching=True)
    assert run(llm) == references(family)
    assert run(llm) == references(family)  # the prompts now hit cached blocks
    assert llm.engine.block_manager.prefix_hits > 0


@pytest.mark.parametrize("family", VARIANTS)
def test_chunked_prefill_and_preemption_keep_outputs_exact(family, moe_dirs, references):
    llm = LLM(moe_dirs[family], block_size=4, num_kv_blocks=14, max_num_batched_tokens=16)
    assert run(llm) == references(family)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 14


def test_layers_are_sparse_or_dense_as_configured(moe_dirs):
    from kubeinfer.engine.model_executor.models.moe import DenseMLP, SparseMoeBlock

    layers = LLM(moe_dirs["qwen3_moe"], block_size=4).engine.runner.model.model.layers
    assert [type(layer.mlp) for layer in layers] == [SparseMoeBlock, DenseMLP, SparseMoeBlock]
    experts = layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (8, 96, 64) and tuple(experts.down_proj.shape) == (8, 64, 48)
    qwen2 = LLM(moe_dirs["qwen2_moe"], block_size=4).engine.runner.model.model.layers[0].mlp
    assert qwen2.shared_expert.intermediate_size == 80


@pytest.mark.parametrize("family, switch", [
    ("qwen3_moe", dict(norm_topk_prob=False)),
    ("qwen3_moe", dict(mlp_only_layers=[])),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0)),
])
def test_the_switches_change_the_reference(family, switch, tmp_path, references):
    """The same seed without the switch gives other outputs: the equality tests above can fail on it."""
    from kubeinfer.dev.testing.random_model import build_random_model

    seed = 40 + list(VARIANTS).index(family)
    twin = build_random_model(tmp_path / family, family, tokenizer=False, seed=seed, **{**VARIANTS[family], **switch})
    assert hf_references(twin, PROMPTS[:3], MAX_TOKENS[:3]) != references(family)[:3]


def test_stacked_checkpoint_layout_loads_the_same(moe_dirs, references, tmp_path):
    """Experts saved stacked (transformers 5's in-memory names: experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]) give the outputs of the per-expert checkpoint."""
    import shutil

    src = moe_dirs["mixtral"]
    shutil.copytree(src, tmp_path / "stacked")
    tensors = load_file(f"{src}/model.safetensors")
    stacked = {}
    for key, tensor in tensors.items():
        if ".experts." not in key:
            stacked[key] = tensor
    for layer in range(2):
        prefix = f"model.layers.{layer}.block_sparse_moe.experts"
        w = {name: torch.stack([tensors[f"{prefix}.{e}.{name}.weight"] for e in range(8)])
             for name in ("w1", "w2", "w3")}
        stacked[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([w["w1"], w["w3"]], dim=1).contiguous()
        stacked[f"model.layers.{layer}.mlp.experts.down_proj"] = w["w2"].contiguous()
    save_file(stacked, str(tmp_path / "stacked" / "model.safetensors"), metadata={"format": "pt"})
    assert run(LLM(str(tmp_path / "stacked"), block_size=4)) == references("mixtral")


def test_a_missing_expert_is_named(moe_dirs, tmp_path):
    import shutil

    from kubeinfer.engine.model_executor.model_loader import ModelLoadError

    shutil.copytree(moe_dirs["qwen3_moe"], tmp_path / "broken")
    tensors = load_file(str(tmp_path / "broken" / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "broken" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.mlp\.experts\.gate_up_proj"):
        LLM(str(tmp_path / "broken"), block_size=4)


def test_expert_weights_on_a_dense_layer_are_refused(moe_dirs, tmp_path):
    import shutil

    from kubeinfer.engine.model_executor.model_loader import ModelLoadError

    shutil.copytree(moe_dirs["qwen3_moe"], tmp_path / "bad")
    tensors = load_file(str(tmp_path / "bad" / "model.safetensors"))
    tensors["model.layers.1.mlp.experts.0.gate_proj.weight"] = torch.zeros(48, 64)
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="that layer is dense"):
        LLM(str(tmp_path / "bad"), block_size=4)


def test_moe_architectures_are_registered_and_listed(capsys):
    import json

    from kubeinfer.cli import main
    from kubeinfer.engine.model_executor.models.moe import MoECausalLM
    from kubeinfer.engine.model_executor.models.registry import model_class

    names = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
    assert all(issubclass(model_class(name), MoECausalLM) for name in names)
    assert main(["models", "--format", "json"]) == 0
    rows = {r["architecture"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(names) <= set(rows) and rows["GptOssForCausalLM"]["quantized"] == "fp8, mxfp4"
