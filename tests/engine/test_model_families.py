"""The wave-3 families (Gemma 2, Gemma 3, Phi-3, OLMo 2, Granite): greedy outputs token-for-token equal to
transformers' generate on tiny random models (every weight random, norms and biases included), in mixed
batches, with the prefix cache on and off, chunked prefill and forced preemption. Sliding windows are
small (6 and 8 tokens) so that prompts cross them; the local/global layer pattern is mixed."""
import pytest
import torch
from test_engine_correctness import MAX_TOKENS, PROMPTS, hf_greedy

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.dev.testing.random_model import save_gemma3_multimodal

SLIDING, FULL = "sliding_attention", "full_attention"
# family -> the config switches its tiny model exercises (each family's own defaults come from random_model)
VARIANTS = {
    "gemma2": dict(num_layers=3, sliding_window=6, layer_types=[SLIDING, FULL, SLIDING],
                   attn_logit_softcapping=3.0, final_logit_softcapping=8.0),
    "gemma3": dict(num_layers=3, sliding_window=6, layer_types=[SLIDING, FULL, SLIDING], tie_word_embeddings=True),
    "phi3": dict(sliding_window=8, partial_rotary_factor=0.5),
    "olmo2": dict(attention_bias=True),
    "granite": dict(attention_bias=True, mlp_bias=True),
}


def hf_references(model_dir) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf_greedy(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]


def run(llm: LLM, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    root = tmp_path_factory.mktemp("families")
    return {family: str(build_random_model(root / family, family, tokenizer=False, seed=20 + i, **variant))
            for i, (family, variant) in enumerate(VARIANTS.items())}


@pytest.fixture(scope="module")
def references(family_dirs):
    cache = {}

    def get(family: str) -> list[list[int]]:
        if family not in cache:
            cache[family] = hf_references(family_dirs[family])
        return cache[family]
    return get


@pytest.mark.parametrize("family", VARIANTS)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_batch_matches_transformers(family, prefix_caching, family_dirs, references):
    llm = LLM(family_dirs[family], block_size=4, enable_prefix_caching=prefix_caching)
    assert run(llm) == references(family)
    assert run(llm) == references(family)  # with the prefix cache on, the prompts now hit cached blocks
    assert (llm.engine.block_manager.prefix_hits > 0) == prefix_caching


@pytest.mark.parametrize("family", VARIANTS)
def test_chunked_prefill_and_preemption_keep_outputs_exact(family, family_dirs, references):
    llm = LLM(family_dirs[family], block_size=4, num_kv_blocks=14, max_num_batched_tokens=16)
    assert run(llm) == references(family)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 14


def test_layers_get_their_own_windows(family_dirs):
    gemma = LLM(family_dirs["gemma3"], block_size=4).engine.runner
    assert [layer.self_attn.window for layer in gemma.model.model.layers] == [6, None, 6]
    assert gemma.sliding_window is None  # no window shared by every layer
    local, full = (gemma.model.model.layers[i].self_attn.rotary for i in (0, 1))
    assert local is not full and full.theta == 40 * local.theta  # Gemma 3's local RoPE base
    phi = LLM(family_dirs["phi3"], block_size=4).engine.runner
    assert phi.sliding_window == 8 and phi.model.model.rotary.head_dim == phi.spec.head_dim // 2


@pytest.mark.parametrize("family, without", [
    ("gemma3", dict(sliding_window=4096)),  # wider than any context here: no window in effect
    # the final cap is monotone, so greedy tokens change by the attention cap (which SDPA before 5.21 dropped)
    ("gemma2", dict(attn_logit_softcapping=None, final_logit_softcapping=None)),
    ("phi3", dict(sliding_window=None)),
    ("phi3", dict(partial_rotary_factor=1.0)),
])
def test_the_switches_change_the_reference(family, without, tmp_path, references):
    """The same weights without the switch give other outputs: the equality tests above can fail on it."""
    from kubeinfer.dev.testing.random_model import build_random_model

    variant = {**VARIANTS[family], **without}
    seed = 20 + list(VARIANTS).index(family)
    twin = build_random_model(tmp_path / family, family, tokenizer=False, seed=seed, **variant)
    assert hf_references(twin) != references(family)


# -- LongRoPE (Phi-3 / Phi-4-mini) ---------------------------------------------------------------------------
SHORT = [1.0, 1.1, 1.2, 1.3]  # rotary dim 8 (head_dim 16, partial_rotary_factor 0.5): 4 frequencies
LONG = [2.0, 2.5, 3.0, 3.5]


@pytest.mark.parametrize("original, max_model_len", [(64, 64), (16, 512)], ids=["short-factors", "long-factors"])
def test_longrope_matches_transformers(original, max_model_len, tmp_path):
    """Short factors when the served context fits the trained one; long factors beyond it. transformers picks
    per forward pass by the longest sequence, so the long case uses prompts all longer than `original`."""
    from kubeinfer.dev.testing.random_model import build_random_model

    path = build_random_model(tmp_path / "phi", "phi3", tokenizer=False, partial_rotary_factor=0.5, seed=5,
                              rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
                              original_max_position_embeddings=original)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [list(range(60, 100)), list(range(100, 130)), list(range(20, 45))]
    want = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(str(path), block_size=4, max_model_len=max_model_len)
    assert run(llm, prompts, [12] * 3) == want


# -- the registry ---------------------------------------------------------------------------------------------
def test_lora_on_an_architecture_without_it_is_refused_clearly(family_dirs, monkeypatch):
    import dataclasses

    from kubeinfer.engine.model_executor.models import registry

    entry = registry.ARCHITECTURES["Olmo2ForCausalLM"]
    monkeypatch.setitem(registry.ARCHITECTURES, entry.name, dataclasses.replace(entry, lora=False))
    with pytest.raises(ValueError, match="LoRA adapters are not supported on Olmo2ForCausalLM"):
        LLM(family_dirs["olmo2"], enable_lora=True)


def test_unknown_architecture_lists_what_is_served():
    from kubeinfer.engine.model_executor.models.registry import ARCHITECTURES, UnsupportedArchitecture, resolve

    with pytest.raises(UnsupportedArchitecture) as error:
        resolve(["GPT2LMHeadModel"])
    assert "GPT2LMHeadModel" in str(error.value)
    assert all(name in str(error.value) for name in ARCHITECTURES)
    assert resolve(["GPT2LMHeadModel", "Gemma3ForCausalLM"]).name == "Gemma3ForCausalLM"  # the first one served


def test_every_architecture_imports_and_is_listed(capsys):
    from kubeinfer.cli import main
    from kubeinfer.engine.model_executor.models.llama import CausalLM
    from kubeinfer.engine.model_executor.models.registry import ARCHITECTURES, model_class

    for name in ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Phi3ForCausalLM",
                 "Olmo2ForCausalLM", "GraniteForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM"):
        assert issubclass(model_class(name), CausalLM)
    assert main(["models", "--format", "json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)
    assert [r["architecture"] for r in rows] == list(ARCHITECTURES)
    assert set(rows[0]) == {"architecture", "family", "LoRA", "sliding window", "tensor parallel", "quantized"}


def test_readme_carries_the_registry_table():
    from pathlib import Path

    from kubeinfer.engine.model_executor.models.registry import markdown_table

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert markdown_table() in readme, "README's model table is stale: paste `kubeinfer models --format markdown`"


def test_gemma3_multimodal_checkpoint_serves_its_text(family_dirs, references, tmp_path):
    """A Gemma3ForConditionalGeneration holding the Gemma 3 test model as its language model (a tiny vision
    tower beside it, left unread) gives the language model's outputs, as transformers' multimodal class does."""
    multimodal = save_gemma3_multimodal(family_dirs["gemma3"], tmp_path / "mm")
    assert [hf_greedy(multimodal, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)] == references("gemma3")
    llm = LLM(str(tmp_path / "mm"), block_size=4)
    assert llm.engine.runner.model.spec.architecture == "Gemma3ForConditionalGeneration"
    assert run(llm) == references("gemma3")


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_mixing_windowed_and_full_layers_matches_transformers(family, tmp_path):
    """use_sliding_window with max_window_layers=1: layer 0 attends to everything, the others to 6 tokens
    (refused before per-layer windows existed)."""
    from kubeinfer.dev.testing.random_model import build_random_model

    variant = dict(num_layers=3, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    path = build_random_model(tmp_path / family, family, tokenizer=False, seed=9, **variant)
    llm = LLM(str(path), block_size=4, num_kv_blocks=14, max_num_batched_tokens=16)
    assert [layer.self_attn.window for layer in llm.engine.runner.model.model.layers] == [None, 6, 6]
    want = hf_references(path)
    assert run(llm) == want
    assert llm.engine.scheduler.num_preemptions > 0
    full = build_random_model(tmp_path / "full", family, tokenizer=False, seed=9, **{**variant, "max_window_layers": 3})
    assert hf_references(full) != want  # the windowed layers change the outputs
