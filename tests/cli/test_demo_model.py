"""The demo model: a tiny build loads in transformers, PEFT and our engine, PEFT agrees with our engine on
the trained adapters, builds are idempotent, and (slow) the real build's adapters write in their styles."""
from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kubeinfer.dev import demo_model
from kubeinfer.dev.demo_model import DemoModelError, DemoRecipe, build_demo_model, read_manifest
from kubeinfer.engine import LLM, LoRARequest, SamplingParams
from kubeinfer.dev.testing.random_model import BOS_ID, EOS_ID, PAD_ID

# A few seconds on 2 cores, yet trained enough that greedy choices are not coin flips between tied logits.
TINY = DemoRecipe(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=400,
                  max_position_embeddings=256, context=32, batch_size=8, base_steps=30, adapter_steps=20,
                  lora_rank=4, lora_alpha=8.0, max_chars_per_style=20_000, draft_hidden_size=32, draft_steps=30)
# For the tests of rebuild logic only: the weights do not matter, the build takes about a second.
MICRO = replace(TINY, base_steps=2, adapter_steps=1, draft_steps=1, max_chars_per_style=5_000)
PROMPTS = ["The", "If the", "def", "This License"]


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo") / "out", recipe=TINY, progress=False)


@pytest.fixture(scope="module")
def tiny_llm(tiny_build) -> LLM:
    return LLM(str(tiny_build / "base"), enable_lora=True, max_lora_rank=TINY.lora_rank, num_kv_blocks=64)


def engine_greedy(llm: LLM, out: Path, adapter: str | None, max_tokens: int = 12, logprobs=None):
    ids = {"legal": 1, "python": 2}
    lora = LoRARequest(adapter, ids[adapter], str(out / "adapters" / adapter)) if adapter else None
    return llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=logprobs),
                        lora_request=lora)


def test_layout_and_manifest(tiny_build):
    manifest = read_manifest(tiny_build)
    assert manifest is not None and manifest["recipe"]["hidden_size"] == TINY.hidden_size
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (tiny_build / "base" / name).is_file(), name
    assert sorted(p.name for p in (tiny_build / "adapters").iterdir()) == ["legal", "python"]
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tiny_build / "draft" / name).is_file(), name
    assert not list(tiny_build.parent.glob(".*partial")), "the temporary build directory was left behind"


def test_the_draft_model_speculates_for_the_base(tiny_build, tiny_llm):
    """The draft is smaller, shares the tokenizer, and the engine takes it: greedy outputs as without it."""
    import json

    base, draft = (json.loads((tiny_build / d / "config.json").read_text()) for d in ("base", "draft"))
    assert draft["num_hidden_layers"] < base["num_hidden_layers"] and draft["hidden_size"] < base["hidden_size"]
    llm = LLM(str(tiny_build / "base"), num_kv_blocks=64,
              speculative_config={"model": str(tiny_build / "draft"), "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=12)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == \
        [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, params)]
    assert llm.engine.speculator.num_draft_tokens > 0


def test_base_loads_in_transformers(tiny_build):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_build / "base")
    assert isinstance(model, LlamaForCausalLM)
    tokenizer = AutoTokenizer.from_pretrained(tiny_build / "base")
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert model.config.vocab_size == len(tokenizer)
    text = "def f(x):\n    return x ** 2  # café, 東京\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text  # byte-level: anything round-trips
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    eos = GenerationConfig.from_pretrained(tiny_build / "base").eos_token_id
    assert set(eos) == {EOS_ID, tokenizer.convert_tokens_to_ids("<|im_end|>")}  # chat answers end


@pytest.mark.parametrize("adapter", ["legal", "python"])
def test_peft_reads_every_saved_tensor(tiny_build, adapter):
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = tiny_build / "adapters" / adapter
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_build / "base"), path)
    loaded = get_peft_model_state_dict(peft_model)
    saved = load_file(str(path / "adapter_model.safetensors"))
    assert set(loaded) == set(saved) and len(saved) == 2 * 7 * TINY.num_layers
    for key, tensor in saved.items():
        torch.testing.assert_close(loaded[key], tensor, rtol=0, atol=0)
    assert any(t.abs().max() > 0 for k, t in saved.items() if "lora_B" in k), "training never moved B off zero"


@pytest.mark.parametrize("adapter", ["legal", "python"])
def test_engine_agrees_with_peft(tiny_build, tiny_llm, adapter):
    """Teacher-force PEFT on the engine's greedy continuation: same log-probabilities, same argmax."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_build / "base"),
                                           tiny_build / "adapters" / adapter).eval()
    for output in engine_greedy(tiny_llm, tiny_build, adapter, logprobs=0):
        completion = output.outputs[0]
        ids = torch.tensor([output.prompt_token_ids + completion.token_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(peft_model(ids).logits[0].float(), dim=-1)
        start = len(output.prompt_token_ids) - 1
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = logprobs[start + step]
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert row[token] >= row.max() - 1e-4  # greedy under PEFT too


def test_adapters_change_the_greedy_answer(tiny_build, tiny_llm):
    answers = {name: [o.outputs[0].token_ids for o in engine_greedy(tiny_llm, tiny_build, name)]
               for name in (None, "legal", "python")}
    assert answers["legal"] != answers[None]
    assert answers["python"] != answers[None]
    assert answers["legal"] != answers["python"]


def test_training_hooks_compute_what_peft_computes(tmp_path):
    """The hooks the adapters are trained with must be PEFT's LoRA, or a trained adapter would be served
    as something else: give B random values, save, and compare logits with PEFT on the saved files."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / "base")
    hooks = demo_model.LoRAHooks(model, rank=4, alpha=12.0, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _, b in hooks.weights.values():
            b.normal_(0, 0.3)
    hooks.save(tmp_path / "adapter", tmp_path / "base", rank=4, alpha=12.0)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        ours = model(ids).logits
        hooks.remove()
        plain = model(ids).logits
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                               tmp_path / "adapter").eval()
        reference = peft_model(ids).logits
    assert not torch.allclose(ours, plain, atol=1e-3)  # the adapter does something
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)


# -- idempotency -----------------------------------------------------------------------------------------
def test_complete_build_is_reused(tiny_build):
    stamp = (tiny_build / demo_model.MANIFEST).stat().st_mtime_ns
    assert build_demo_model(tiny_build, recipe=TINY, progress=False) == tiny_build
    assert build_demo_model(tiny_build, progress=False) == tiny_build  # no recipe asked: any complete build
    assert (tiny_build / demo_model.MANIFEST).stat().st_mtime_ns == stamp


def test_partial_build_is_rebuilt(tmp_path):
    out = build_demo_model(tmp_path / "demo", recipe=MICRO, progress=False)
    weights = out / "adapters" / "python" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # as if the copy was cut short
    assert read_manifest(out) is None
    build_demo_model(out, recipe=MICRO, progress=False)
    assert read_manifest(out) is not None
    (out / demo_model.MANIFEST).unlink()  # as if the build died before its last write
    build_demo_model(out, recipe=MICRO, progress=False)
    assert read_manifest(out) is not None


def test_force_and_a_changed_recipe_rebuild(tmp_path):
    out = build_demo_model(tmp_path / "demo", recipe=MICRO, progress=False)
    first = json.loads((out / demo_model.MANIFEST).read_text())
    build_demo_model(out, recipe=MICRO, steps=6, progress=False)
    second = json.loads((out / demo_model.MANIFEST).read_text())
    assert (second["recipe"]["base_steps"], second["recipe"]["adapter_steps"]) == (6, 2)
    build_demo_model(out, recipe=MICRO, steps=6, force=True, progress=False)
    third = json.loads((out / demo_model.MANIFEST).read_text())
    assert first["recipe"] != second["recipe"] == third["recipe"]
    assert (out / demo_model.MANIFEST).is_file() and not list(tmp_path.glob(".*"))


def test_refuses_to_replace_a_directory_that_is_not_a_demo_model(tmp_path):
    precious = tmp_path / "work"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(DemoModelError, match="notes.txt"):
        build_demo_model(precious, recipe=MICRO, progress=False)
    assert (precious / "notes.txt").read_text() == "keep me"


def test_cli_reports_errors_and_reuse(tiny_build, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    demo_model.add_arguments(parser)
    assert demo_model.run(parser.parse_args([str(tmp_path / "x"), "--steps", "0"])) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
    assert demo_model.run(parser.parse_args([str(tiny_build)])) == 0
    printed = capsys.readouterr().out
    assert "reusing" in printed and f"legal={tiny_build / 'adapters' / 'legal'}" in printed


# -- the real build (minutes) ---------------------------------------------------------------------------------
def _words(text: str) -> list[str]:
    """Words, and punctuation one mark at a time: code's ( : = . matter as much as legal vocabulary."""
    return re.findall(r"[A-Za-z_]+|[^\sA-Za-z0-9_]", text)


def _style_models(corpora: dict[str, list[str]]) -> dict[str, callable]:
    """Add-one smoothed unigram models of each style's training text: mean log-likelihood per word."""
    counts = {style: Counter(w for text in texts for w in _words(text)) for style, texts in corpora.items()}
    vocabulary = len(set().union(*counts.values()))

    def model(count: Counter):
        total = sum(count.values()) + vocabulary
        return lambda words: sum(math.log((count[w] + 1) / total) for w in words) / max(1, len(words))
    return {style: model(count) for style, count in counts.items()}


@pytest.mark.slow
def test_real_demo_model_adapters_write_in_their_styles(tmp_path):
    import time

    started = time.perf_counter()
    out = build_demo_model(tmp_path / "demo", progress=False)
    assert time.perf_counter() - started < 300, "the demo model must build within 5 minutes on 2 cores"
    samples = demo_model.greedy_samples(out, max_tokens=48)
    models = _style_models(demo_model.load_corpora(DemoRecipe().max_chars_per_style))

    def legal_over_python(texts: list[str]) -> float:
        words = [w for text in texts for w in _words(text)]
        return models["legal"](words) - models["python"](words)

    print(json.dumps(samples, indent=1))
    legal, python, base = (legal_over_python(samples[name]) for name in ("legal", "python", "base"))
    assert legal > 0 > python, f"legal adapter {legal:.2f}, python adapter {python:.2f} (legal - python log-lik)"
    assert legal > base > python  # each adapter moves the base towards its own style
    per_prompt = [legal_over_python([a]) > legal_over_python([b]) for a, b in zip(samples["legal"], samples["python"])]
    assert sum(per_prompt) >= len(per_prompt) - 1, per_prompt
