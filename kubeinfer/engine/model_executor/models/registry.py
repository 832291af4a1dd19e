"""Which architectures the engine serves: the `architectures` name of a Hugging Face config -> the module and
class that implement it, with the features each supports. Plain data, no torch: `kubeinfer models` and the
README table read it without loading a model; the class is imported only when a model is loaded."""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..layers.quantization.registry import for_every_architecture


@dataclass(frozen=True)
class Architecture:
    name: str  # as in config.json's "architectures"
    module: str  # under kubeinfer/engine/model_executor/models/
    class_name: str
    family: str
    lora: bool  # adapters load and apply (checked against PEFT)
    sliding_window: str  # "no", "all layers" (when the config sets one) or "per layer" (by the config's layer_types)
    tensor_parallel: bool = False
    # the quantization_config methods served (the loader dequantizes any dense family alike, and the MoE families'
    # per-expert tensors into their stacked experts): the registered methods every architecture serves
    # (quantization/methods.py); a family's own format (mxfp4, gpt-oss's experts) is named by that family
    quantized: str = ", ".join(for_every_architecture())
    text_only: bool = False  # a multimodal checkpoint served as its language model (its text_config)


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", "llama", "CausalLM", "Llama",
                 lora=True, sliding_window="no", tensor_parallel=True),
    Architecture("MistralForCausalLM", "llama", "CausalLM", "Mistral",
                 lora=True, sliding_window="all layers", tensor_parallel=True),
    Architecture("Qwen2ForCausalLM", "llama", "CausalLM", "Qwen2",
                 lora=True, sliding_window="per layer", tensor_parallel=True),
    Architecture("Qwen3ForCausalLM", "llama", "CausalLM", "Qwen3",
                 lora=True, sliding_window="per layer", tensor_parallel=True),
    Architecture("Gemma2ForCausalLM", "gemma", "Gemma2ForCausalLM", "Gemma 2",
                 lora=True, sliding_window="per layer", tensor_parallel=True),
    Architecture("Gemma3ForCausalLM", "gemma", "Gemma3ForCausalLM", "Gemma 3 (text)", lora=True,
                 sliding_window="per layer", tensor_parallel=True),
    Architecture("Gemma3ForConditionalGeneration", "gemma", "Gemma3TextOnly", "Gemma 3 (text only; no images)",
                 lora=False, sliding_window="per layer", text_only=True, tensor_parallel=True),
    Architecture("Phi3ForCausalLM", "phi3", "Phi3ForCausalLM", "Phi-3, Phi-4-mini", lora=True,
                 sliding_window="all layers", tensor_parallel=True),
    Architecture("Olmo2ForCausalLM", "olmo2", "Olmo2ForCausalLM", "OLMo 2",
                 lora=True, sliding_window="no", tensor_parallel=True),
    Architecture("GraniteForCausalLM", "granite", "GraniteForCausalLM", "Granite",
                 lora=True, sliding_window="no", tensor_parallel=True),
    # Mixtures of experts (models/moe.py): LoRA on the attention projections; adapters on experts are refused
    Architecture("Qwen2MoeForCausalLM", "qwen_moe", "Qwen2MoeForCausalLM", "Qwen2-MoE (MoE)", lora=True,
                 sliding_window="per layer", tensor_parallel=True),
    Architecture("Qwen3MoeForCausalLM", "qwen_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE (MoE)", lora=True,
                 sliding_window="per layer", tensor_parallel=True),
    Architecture("MixtralForCausalLM", "mixtral", "MixtralForCausalLM", "Mixtral (MoE)", lora=True,
                 sliding_window="all layers", tensor_parallel=True),
    Architecture("GptOssForCausalLM", "gpt_oss", "GptOssForCausalLM", "gpt-oss (MoE)", lora=True,
                 sliding_window="per layer", quantized="fp8, mxfp4", tensor_parallel=True),
)}


class UnsupportedArchitecture(ValueError):
    pass


def resolve(architectures: list[str]) -> Architecture:
    """The first of a config's `architectures` that is served; a clear error listing what is, otherwise."""
    for name in architectures:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise UnsupportedArchitecture(f"unsupported architecture {architectures or '(none in config.json)'}; "
                                  f"kubeinfer serves {', '.join(ARCHITECTURES)} (see `kubeinfer models`)")


def model_class(name: str) -> type:
    entry = resolve([name])
    module = importlib.import_module(f"{__package__}.{entry.module}")
    return getattr(module, entry.class_name)


def feature_table() -> list[dict[str, str]]:
    """One row per architecture, as `kubeinfer models` prints it and the README shows it."""
    def yes(flag: bool) -> str:
        return "yes" if flag else "no"
    return [{"architecture": a.name, "family": a.family, "LoRA": yes(a.lora), "sliding window": a.sliding_window,
             "tensor parallel": yes(a.tensor_parallel), "quantized": a.quantized or "no"}
            for a in ARCHITECTURES.values()]


def markdown_table() -> str:
    rows = feature_table()
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(f"`{r[h]}`" if h == "architecture" else r[h] for h in header) + " |" for r in rows]
    return "\n".join(lines)
