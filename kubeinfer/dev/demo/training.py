"""Training the demo base model, its LoRA adapters (forward hooks on the frozen base) and its draft model
(distilled from the base, for speculative decoding), and saving them in Hugging Face and PEFT layouts."""
from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kubeinfer.dev.demo.corpus import WindowSampler, _encode, batch_sampler, load_corpora, train_tokenizer
from kubeinfer.dev.demo.recipe import ADAPTER_STYLES, LORA_TARGETS, STYLES, DemoRecipe

if TYPE_CHECKING:  # torch is imported where it is used: `kubeinfer --help` and the gateway never pay for it
    import torch


# -- training -----------------------------------------------------------------------------------------------
def train(model: torch.nn.Module, params: list[torch.nn.Parameter], sample: Callable[[], torch.Tensor],
          steps: int, lr: float, label: str, progress: bool, loss_of: Callable | None = None) -> float:
    """AdamW with linear warm-up and cosine decay to a tenth; returns the mean loss of the last tenth.
    `loss_of(rows, logits)`: the loss (default: cross-entropy on the next tokens)."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 10)
    losses: list[float] = []
    model.train()
    bar = tqdm(range(steps), desc=label, disable=not progress, leave=False, file=sys.stderr)
    for step in bar:
        scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        rows = sample()
        logits = model(input_ids=rows[:, :-1]).logits
        loss = loss_of(rows, logits) if loss_of else F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.2f}")
    model.eval()
    tail = losses[-max(1, steps // 10):]
    return sum(tail) / len(tail)


class LoRAHooks:
    """Trainable low-rank deltas added to the outputs of the frozen base projections by forward hooks: no
    module is replaced, so the base model stays exactly as saved. B starts at zero, as in PEFT."""

    def __init__(self, model: torch.nn.Module, rank: int, alpha: float, generator: torch.Generator) -> None:
        import torch

        self.scaling = alpha / rank
        self.weights: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
        self._handles = []
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGETS:
                a = torch.nn.Parameter(torch.randn(rank, module.in_features, generator=generator)
                                       / math.sqrt(module.in_features))
                b = torch.nn.Parameter(torch.zeros(module.out_features, rank))
                self.weights[name] = (a, b)
                self._handles.append(module.register_forward_hook(self._delta(a, b)))

    def _delta(self, a: torch.nn.Parameter, b: torch.nn.Parameter):
        def hook(module, inputs, output):
            return output + (inputs[0] @ a.T) @ b.T * self.scaling
        return hook

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for pair in self.weights.values() for p in pair]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def save(self, out: Path, base_dir: Path, rank: int, alpha: float) -> None:
        """PEFT's layout: `base_model.model.<module>.lora_A.weight`, and a LoraConfig as JSON."""
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, (a, b) in self.weights.items():
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.detach().contiguous()
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.detach().contiguous()
        save_file(tensors, str(out / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_dir),
                  "r": rank, "lora_alpha": alpha, "target_modules": list(LORA_TARGETS), "lora_dropout": 0.0,
                  "bias": "none", "use_rslora": False}
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


# -- base model and adapters -------------------------------------------------------------------------------
def _train_all(work: Path, final: Path, recipe: DemoRecipe, progress: bool) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from kubeinfer.dev.testing.random_model import BOS_ID, EOS_ID, PAD_ID

    torch.manual_seed(recipe.seed)
    generator = torch.Generator().manual_seed(recipe.seed)
    corpora = load_corpora(recipe.max_chars_per_style)
    tokenizer = train_tokenizer(corpora, recipe.vocab_size, recipe.max_position_embeddings)
    questions = _encode(tokenizer, corpora["docs"])
    samplers = {style: WindowSampler(tokenizer, corpora[style], recipe, generator, questions) for style in STYLES}

    config = AutoConfig.for_model(
        "llama", vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_kv_heads,
        intermediate_size=recipe.intermediate_size, max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=False, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Docs are the base's own voice; the other two styles are there so it knows their words.
    mixed = batch_sampler([samplers[s] for s in STYLES], [0.5, 0.25, 0.25], recipe.batch_size, generator)
    losses = {"base": train(model, list(model.parameters()), mixed, recipe.base_steps, recipe.base_lr,
                            "demo base model", progress)}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, im_end],
                                               pad_token_id=PAD_ID)
    model.save_pretrained(work / "base")
    tokenizer.save_pretrained(work / "base")

    model.requires_grad_(False)
    for style in ADAPTER_STYLES:
        lora = LoRAHooks(model, recipe.lora_rank, recipe.lora_alpha, generator)
        only_style = batch_sampler([samplers[style]], [1.0], recipe.batch_size, generator)
        losses[style] = train(model, lora.parameters(), only_style, recipe.adapter_steps, recipe.adapter_lr,
                              f"adapter {style}", progress)
        lora.save(work / "adapters" / style, final / "base", recipe.lora_rank, recipe.lora_alpha)
        lora.remove()
    draft, losses["draft"] = _train_draft(model, mixed, recipe, progress)
    draft.save_pretrained(work / "draft")
    tokenizer.save_pretrained(work / "draft")  # the engine checks that a draft shares the target's tokenizer
    return losses


def _train_draft(base: torch.nn.Module, sample: Callable[[], torch.Tensor], recipe: DemoRecipe,
                 progress: bool) -> tuple[torch.nn.Module, float]:
    """A thin model taught to predict what the base predicts (the KL divergence from the base's next-token
    distribution on the training windows), so that its greedy guesses are often the base's tokens."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    config = base.config.__class__.from_dict({
        **base.config.to_dict(), "hidden_size": recipe.draft_hidden_size, "num_hidden_layers": recipe.draft_num_layers,
        "intermediate_size": recipe.draft_intermediate_size, "num_attention_heads": recipe.draft_num_heads,
        "num_key_value_heads": recipe.draft_num_kv_heads})
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    draft.generation_config = base.generation_config

    def distillation(rows: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = F.log_softmax(base(input_ids=rows[:, :-1]).logits, dim=-1).flatten(0, 1)
        return F.kl_div(F.log_softmax(logits, dim=-1).flatten(0, 1), target, log_target=True, reduction="batchmean")

    loss = train(draft, list(draft.parameters()), sample, recipe.draft_steps, recipe.draft_lr, "demo draft model",
                 progress, distillation)
    return draft, loss
