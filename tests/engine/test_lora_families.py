"""LoRA on the wave-3 families: greedy outputs equal to transformers + PEFT, in batches mixing the base
model and two adapters (attention only; every projection). Phi-3's checkpoints hold qkv_proj and
gate_up_proj, so its adapters target those fused modules, and each is one part of our projection."""
from __future__ import annotations

import pytest
from lora_helpers import ALL_MODULES, PROMPTS, hf_greedy, load_hf, make_peft_adapter
from test_model_families import VARIANTS

from kubeinfer.engine import LLM, LoRARequest, SamplingParams

TARGETS = {  # family -> (attention-only targets, all targets)
    "phi3": (["qkv_proj"], ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
}
DEFAULT_TARGETS = (["q_proj", "k_proj", "v_proj", "o_proj"], ALL_MODULES)
FAMILIES = ["gemma2", "gemma3", "phi3", "olmo2", "granite"]


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_adapters_match_peft(family, tmp_path):
    from kubeinfer.dev.testing.random_model import build_random_model

    base = build_random_model(tmp_path / "base", family, tokenizer=False, seed=40, **VARIANTS[family])
    want_base = [hf_greedy(load_hf(base), p) for p in PROMPTS]
    attn, every = TARGETS.get(family, DEFAULT_TARGETS)
    adapters = {"attn": dict(r=4, lora_alpha=8, target_modules=attn),
                "all": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=every)}
    prompts, loras, expected = [], [], []
    references = {}
    for i, (name, config) in enumerate(adapters.items()):
        peft_model = make_peft_adapter(base, tmp_path / name, seed=300 + i, scale=0.25, **config)
        references[name] = [hf_greedy(peft_model, p) for p in PROMPTS]
        assert references[name] != want_base  # the adapter changes the outputs: equality is about it
    for p, prompt in enumerate(PROMPTS):
        for i, name in enumerate([None, *adapters]):
            prompts.append({"prompt_token_ids": prompt})
            loras.append(LoRARequest(name, i, str(tmp_path / name)) if name else None)
            expected.append(references[name][p] if name else want_base[p])
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * len(prompts)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
    assert got == expected


def test_phi3_refuses_adapters_for_split_projections(tmp_path):
    """An adapter trained on q_proj/k_proj (a Llama's) does not fit Phi-3's fused modules: a clear error."""
    from transformers import AutoConfig

    from kubeinfer.engine.config import ModelSpec
    from kubeinfer.engine.lora.adapter import LoRALoadError, load_adapter
    from kubeinfer.dev.testing.random_model import build_random_adapter, build_random_model

    base = build_random_model(tmp_path / "phi", "phi3", tokenizer=False)
    llama = build_random_model(tmp_path / "llama", "llama", tokenizer=False)
    adapter = build_random_adapter(tmp_path / "adapter", llama)
    spec = ModelSpec(AutoConfig.from_pretrained(base), "Phi3ForCausalLM")
    with pytest.raises(LoRALoadError, match="qkv_proj, o_proj, gate_up_proj, down_proj"):
        load_adapter(adapter, spec, 64, lora_id=1)
