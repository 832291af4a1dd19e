"""Model directories: sharded weights, tied embeddings, RoPE scaling, and clear errors."""
import json
import shutil

import pytest
import torch

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.model_executor.model_loader import ModelLoadError
from kubeinfer.dev.testing.random_model import build_random_model

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


def engine_greedy(path, n=12):
    out = LLM(str(path)).generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return out[0].outputs[0].token_ids


def hf_greedy(path, n=12):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("variant", [
    dict(family="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    dict(family="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    dict(family="qwen2", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    dict(family="qwen2", tie_word_embeddings=True),
    dict(family="llama", max_shard_size="100KB"),
    dict(family="mistral", sliding_window=6),
    dict(family="qwen3", num_kv_heads=1, head_dim=32),
], ids=["llama3-rope", "linear-rope", "yarn-rope", "tied-embeddings", "sharded", "sliding-window", "qwen3-mqa-wide-heads"])
def test_variants_match_transformers(variant, tmp_path):
    path = build_random_model(tmp_path / "m", tokenizer=False, hidden_size=64, **variant)
    if "max_shard_size" in variant:
        assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 1
    assert engine_greedy(path) == hf_greedy(path)


def test_unsupported_architecture_is_named(llama_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        LLM(str(path))


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(tmp_path / "empty"))


def test_pickle_checkpoints_are_refused(llama_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(llama_dir, path)
    for f in path.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(path))


def test_missing_shard_and_missing_weight(tmp_path):
    path = build_random_model(tmp_path / "m", "llama", tokenizer=False, max_shard_size="100KB")
    shard = sorted(path.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        LLM(str(path))


def test_incomplete_checkpoint_names_missing_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    path = build_random_model(tmp_path / "m", "llama", tokenizer=False)
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.gate_up_proj"):
        LLM(str(path))
