"""Tiny random-init Hugging Face model directories, built offline, for tests, benchmarks and demos.

There is no model hub here, so every checkpoint the project exercises is made locally: a byte-level
BPE tokenizer trained on text found on disk and a few-layer model of one of the supported families,
saved the way `from_pretrained` expects (config.json, safetensors, generation_config.json, tokenizer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedTokenizerFast,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from kubeinfer.dev.file_modes import share_readable

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# The families added in wave 3, by their name here -> transformers' model_type.
NEW_FAMILIES = {"gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3", "olmo2": "olmo2", "granite": "granite"}
# Mixtures of experts: 8 experts, top-2, expert sizes unlike the hidden size (a transposed load shows).
MOE_FAMILIES = {"qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "gpt_oss": "gpt_oss"}
NEW_FAMILIES.update(MOE_FAMILIES)
ALL_FAMILIES = FAMILIES + tuple(NEW_FAMILIES)

# Fixed order, so the ids are known even when no tokenizer is built: pad=0, bos=1, eos=2.
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# ChatML, with tools rendered as Qwen's templates do: a system block listing them, calls in <tool_call> tags.
CHATML_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ '</tools><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson"
    " + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_LICENSE_DIR = Path("/usr/share/common-licenses")


def _fallback_corpus() -> list[str]:
    """Plain English generated in code, for machines without /usr/share/common-licenses."""
    subjects = ("The server", "A request", "The scheduler", "Each token", "The model", "A user")
    verbs = ("reads", "writes", "waits for", "returns", "streams", "caches")
    objects = ("the next batch", "a long prompt", "the key and value blocks", "an answer", "the weights")
    tails = ("quickly.", "before the deadline.", "in order.", "when memory is free.", "again and again.")
    lines = [f"{s} {v} {o} {t}" for s in subjects for v in verbs for o in objects for t in tails]
    return lines + ["0123456789 +-*/=()[]{}<>,.;:!?'\"@#$%&_ \t\n"]


def _corpus() -> list[str]:
    """Sorted file order keeps the trained merges (and so every token id) deterministic."""
    texts: list[str] = []
    if _LICENSE_DIR.is_dir():
        for path in sorted(_LICENSE_DIR.iterdir()):
            if path.is_file():
                texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts or _fallback_corpus()


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with ChatML specials and save it to `out_dir`.

    Byte-level with the full 256-byte alphabet and no normalizer, so any unicode string round-trips.
    No BOS is prepended automatically (Qwen-style); callers add it if they want it.

    The split regex is Qwen2's: for model_type "qwen2", AutoTokenizer ignores tokenizer.json's
    pipeline and rebuilds a Qwen2Tokenizer (NFC + this regex) from the vocab and merges, so using
    the same regex keeps the ids identical on both load paths (for NFC text).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        # Byte-level BPE never emits an unknown token, but Qwen2Tokenizer would otherwise add its own
        # "<|endoftext|>" as unk, growing len(tokenizer) past the model's vocab (Qwen reuses eos too).
        unk_token="<|eos|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,  # the cleanup rewrites " ." and would break round-trips
        model_max_length=1 << 20,
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out)
    return fast


def _rope_parameters(rope_scaling: dict[str, Any] | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 keeps theta and scaling together in `config.rope_parameters`."""
    params = dict(rope_scaling or {})
    if "type" in params:  # the pre-v5 spelling
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", float(overrides.pop("rope_theta", 10_000.0)))
    return params


def _family_defaults(family: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Settings that make a tiny model of the family exercise its own switches."""
    head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    if family in ("gemma2", "gemma3"):
        extra: dict[str, Any] = dict(query_pre_attn_scalar=head_dim // 2)  # not head_dim: a wrong scale shows
        if family == "gemma3":  # local and global layers with their own RoPE bases
            theta = fields["rope_parameters"]["rope_theta"]
            extra["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": theta},
                                        "full_attention": {**fields["rope_parameters"], "rope_theta": 40 * theta}}
        return extra
    if family in MOE_FAMILIES:
        return _moe_defaults(family, head_dim)
    if family == "granite":  # away from 1, so that a multiplier left out shows
        return dict(embedding_multiplier=1.5, residual_multiplier=0.7, attention_multiplier=0.4, logits_scaling=2.0)
    return {}


def _moe_defaults(family: str, head_dim: int) -> dict[str, Any]:
    top_k = dict(num_experts_per_tok=2)
    if family == "qwen3_moe":
        return dict(num_experts=8, moe_intermediate_size=48, norm_topk_prob=True, head_dim=head_dim, **top_k)
    if family == "qwen2_moe":
        return dict(num_experts=8, moe_intermediate_size=48, shared_expert_intermediate_size=80, **top_k)
    if family == "mixtral":
        return dict(num_local_experts=8, **top_k)
    # gpt-oss: a low swiglu_limit so that the clamps bite at this init scale; alternating windowed/full layers
    return dict(num_local_experts=8, head_dim=head_dim, swiglu_limit=1.5, sliding_window=6,
                **top_k)


@torch.no_grad()
def _randomize(model: torch.nn.Module, initializer_range: float, generator: torch.Generator) -> None:
    """Make norms and biases matter: the default init sets RMSNorm weights to 1 and biases to 0,
    which would let a kernel that drops them still match the reference."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):  # input/post_attention layernorm, final norm, q_norm, k_norm
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(1.0 + 0.2 * noise)
        elif name.endswith(("sinks", "router.weight", "mlp.gate.weight")):  # MoE routers, attention sinks
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32))
        elif name.endswith((".bias", "_bias")):  # qwen2 q/k/v projections; gpt-oss's experts
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(initializer_range * noise)


def build_random_model(
    out_dir: str | Path,
    family: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.3,
    rope_scaling: dict[str, Any] | None = None,
    max_shard_size: str | None = None,
    seed: int = 0,
    tokenizer: bool = True,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Build and save a random-init <family>ForCausalLM (plus tokenizer) into `out_dir`; return it.

    `initializer_range` defaults to 0.3 because 0.02 gives near-tied logits, and greedy comparisons
    between implementations then flip on rounding. Extra keyword arguments go to the config.
    """
    if family not in ALL_FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {ALL_FAMILIES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    if tokenizer:
        tok = build_tokenizer(out, vocab_size=min(vocab_size or 512, 512))
        if vocab_size is not None and vocab_size < len(tok):
            raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tok)} tokens")
        vocab_size = vocab_size or len(tok)
    vocab_size = vocab_size or 512

    overrides = dict(config_overrides)
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        rope_parameters=_rope_parameters(rope_scaling, overrides),
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    if family in ("qwen3", "gemma2", "gemma3"):  # their configs default head_dim (128, 256) instead of deriving it
        fields["head_dim"] = hidden_size // num_heads
    fields.update(_family_defaults(family, fields))
    fields.update(overrides)
    config = AutoConfig.for_model(NEW_FAMILIES.get(family, family), **fields)

    # Seed the global RNG for the module init (it does not take a generator), then a private one.
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, initializer_range, torch.Generator().manual_seed(seed + 1))
    model = model.to(dtype)  # init in fp32, then round: a bf16 model is the fp32 one rounded
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    # transformers 5 always writes safetensors; sharding adds model.safetensors.index.json.
    save_kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **save_kwargs)
    return share_readable(out)


def build_random_adapter(out_dir: str | Path, model_dir: str | Path, *, rank: int = 8, alpha: float = 16.0,
                         target_modules: tuple[str, ...] | None = None, scale: float = 0.02, seed: int = 0) -> Path:
    """Save a random LoRA adapter for the model in `model_dir`, in PEFT's format (adapter_config.json +
    adapter_model.safetensors, PEFT's tensor names), without needing PEFT installed."""
    import json

    from safetensors.torch import save_file

    from kubeinfer.engine.config import ModelSpec
    from kubeinfer.engine.lora.adapter import module_shapes

    config = AutoConfig.from_pretrained(model_dir)
    spec = ModelSpec(config, config.architectures[0])
    shapes = module_shapes(spec)
    target_modules = tuple(shapes) if target_modules is None else target_modules  # default: every projection
    parents = {m: "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj") else "mlp" for m in shapes}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module in target_modules:
            in_features, out_features = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{parents[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = scale * torch.randn(rank, in_features, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = scale * torch.randn(out_features, rank, generator=generator)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir), "r": rank,
        "lora_alpha": alpha, "target_modules": list(target_modules), "lora_dropout": 0.0, "bias": "none"}, indent=2))
    return share_readable(out)


def save_gemma3_multimodal(text_dir: str | Path, out_dir: str | Path):
    """A Gemma3ForConditionalGeneration whose language model is the Gemma 3 text model in `text_dir`, with a
    tiny random vision tower beside it, saved to `out_dir`; returns the transformers model."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=16)
    config = Gemma3Config(text_config=text.config.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=500, boi_token_index=501, eoi_token_index=502)
    multimodal = Gemma3ForConditionalGeneration(config).eval()
    multimodal.model.language_model.load_state_dict(text.model.state_dict())
    multimodal.lm_head.weight = multimodal.model.language_model.embed_tokens.weight
    multimodal.save_pretrained(out_dir)
    share_readable(out_dir)
    return multimodal
