"""PEFT adapters with random weights, saved in PEFT's format: the reference every LoRA test compares to."""
from __future__ import annotations

from pathlib import Path

import torch


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
    return model
