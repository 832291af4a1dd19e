"""LoRA on the mixture-of-experts families: adapters on the attention projections give PEFT's outputs in batches
mixing the base model and an adapter; adapters on expert (or any MLP) weights are refused at load, naming the
module."""
from __future__ import annotations

import json

import pytest
import torch
from lora_helpers import PROMPTS, hf_greedy, make_peft_adapter
from safetensors.torch import save_file

from kubeinfer.engine import LLM, LoRARequest, SamplingParams
from kubeinfer.engine.lora.adapter import LoRALoadError

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize("family, tp", [("qwen3_moe", 1), ("gpt_oss", 1),
                                        pytest.param("qwen3_moe", 2, marks=pytest.mark.slow, id="qwen3_moe-tp2")])
def test_attention_adapters_match_peft(family, tp, tmp_path):
    """tp 2: A and B cut like the attention projections on each rank, beside each rank's slice of the experts."""
    from test_moe_models import hf_model

    from kubeinfer.dev.testing.random_model import build_random_model

    base = build_random_model(tmp_path / "base", family, tokenizer=False, seed=60, num_layers=2)
    want_base = [hf_greedy(hf_model(base), p) for p in PROMPTS]
    peft_model = make_peft_adapter(base, tmp_path / "attn", seed=61, scale=0.25, r=4, lora_alpha=8,
                                   target_modules=ATTENTION)
    peft_model.base_model.model.set_experts_implementation("eager")
    want = [hf_greedy(peft_model, p) for p in PROMPTS]
    assert want != want_base
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, block_size=4, tensor_parallel_size=tp)
    try:
        adapter = LoRARequest("attn", 1, str(tmp_path / "attn"))
        prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in range(2)]
        loras = [adapter if i % 2 else None for i in range(len(prompts))]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
        assert got == [w for pair in zip(want_base, want) for w in pair]
    finally:
        llm.shutdown()


def write_adapter(path, modules: list[str], config_extra: dict | None = None):
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module in modules:
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.zeros(4, 64)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.zeros(48, 4)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"], **(config_extra or {})}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def moe_spec(tmp_path_factory):
    from transformers import AutoConfig

    from kubeinfer.engine.config import ModelSpec
    from kubeinfer.dev.testing.random_model import build_random_model

    path = build_random_model(tmp_path_factory.mktemp("moe_lora"), "qwen2_moe", tokenizer=False, num_layers=2)
    return ModelSpec(AutoConfig.from_pretrained(path), "Qwen2MoeForCausalLM")


@pytest.mark.parametrize("module", ["model.layers.1.mlp.experts.3.gate_proj",
                                    "model.layers.0.mlp.shared_expert.up_proj", "model.layers.0.mlp.gate",
                                    "model.layers.0.block_sparse_moe.experts.0.w1"])
def test_adapters_on_expert_weights_are_refused_naming_the_module(module, moe_spec, tmp_path):
    from kubeinfer.engine.lora.adapter import load_adapter

    adapter = write_adapter(tmp_path / "a", [module])
    with pytest.raises(LoRALoadError, match=rf"targets {module}, an MLP weight .* attention projections only"):
        load_adapter(adapter, moe_spec, 64, lora_id=1)


def test_target_parameters_on_stacked_experts_are_refused(moe_spec, tmp_path):
    from kubeinfer.engine.lora.adapter import load_adapter

    adapter = write_adapter(tmp_path / "a", ["model.layers.0.self_attn.q_proj"],
                            {"target_parameters": ["mlp.experts.gate_up_proj"], "target_modules": ["q_proj"]})
    with pytest.raises(LoRALoadError, match="target_parameters, e.g. a mixture of experts' stacked experts"):
        load_adapter(adapter, moe_spec, 64, lora_id=1)


def test_mlp_target_names_are_refused_on_moe_models(moe_spec, tmp_path):
    from kubeinfer.engine.lora.adapter import load_adapter

    adapter = tmp_path / "b"
    write_adapter(adapter, ["model.layers.0.self_attn.q_proj"], {"target_modules": ["q_proj", "down_proj"]})
    with pytest.raises(LoRALoadError, match=r"down_proj, .*mixture of experts.*q_proj, k_proj, v_proj, o_proj"):
        load_adapter(adapter, moe_spec, 64, lora_id=1)
