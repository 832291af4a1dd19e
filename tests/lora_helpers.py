"""PEFT adapters with random weights, saved in PEFT's format: the reference every LoRA test compares to."""
from __future__ import annotations

from pathlib import Path

import torch

from kubeinfer.dev.file_modes import share_readable


def load_hf(base_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()


def make_peft_adapter(base_dir, out_dir: Path, seed: int, scale: float = 0.3, **lora_config):
    """Wrap the base model in a PEFT LoRA, give every LoRA weight random values (PEFT starts B at zero,
    which would make every delta vanish), save it to `out_dir` and return the PEFT model."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_hf(base_dir), LoraConfig(**lora_config)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(scale * torch.randn(param.shape, generator=generator))
    model.save_pretrained(out_dir)
    share_readable(out_dir)
    return model


ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Three adapters of different ranks, scalings and target sets, for the engine and server tests.
ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all": dict(r=6, lora_alpha=12, use_rslora=True, target_modules=ALL_MODULES),
}
PROMPTS = [list(range(20, 33)), [7, 8, 9], list(range(100, 121)), [50, 51, 52, 53, 54]]
MAX_TOKENS = 8


def hf_greedy(model, prompt: list[int], max_new_tokens: int = MAX_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


def mixed_batch(lora_adapters, lora_base_reference):
    """Every prompt under the base model and under each adapter, interleaved: (prompts, loras, expected)."""
    prompts, loras, expected = [], [], []
    for p, prompt in enumerate(PROMPTS):
        for name in [None, *ADAPTERS]:
            prompts.append({"prompt_token_ids": prompt})
            loras.append(lora_adapters[name][0] if name else None)
            expected.append(lora_adapters[name][1][p] if name else lora_base_reference[p])
    return prompts, loras, expected
