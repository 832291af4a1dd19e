"""Shared fixtures: tiny random-init Hugging Face models of each supported family, built once per session."""
from __future__ import annotations

import os

import pytest
import torch
import transformers_fixes

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run in its CPU interpreter, which must be chosen before anything imports
# triton (transformers may): here, before any test module loads, whichever runs alone or first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# References from older transformers releases get their upstream fixes (see transformers_fixes.py); after the
# line above, since patching imports transformers on those releases.
FIXES = transformers_fixes.apply()


def pytest_report_header(config):
    if FIXES:
        return f"transformers {transformers_fixes.transformers_version()}: reference fixes {', '.join(FIXES)}"


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    from kubeinfer.dev.testing.random_model import FAMILIES, build_random_model

    root = tmp_path_factory.mktemp("models")
    return {family: str(build_random_model(root / family, family, seed=i)) for i, family in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def long_context_dir(tmp_path_factory) -> str:
    """A llama with a context of 2048: rendered tools take ~500 tokens of this byte-level vocabulary (tools,
    the Responses API, client libraries)."""
    from kubeinfer.dev.testing.random_model import build_random_model

    return str(build_random_model(tmp_path_factory.mktemp("long_context"), "llama", max_position_embeddings=2048))


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def hf_models(model_dirs):
    """The transformers reference implementation of each family, loaded from the same directory."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = AutoModelForCausalLM.from_pretrained(model_dirs[family], dtype=torch.float32).eval()
        return cache[family]
    return get


# -- LoRA: a base model, three PEFT adapters and the greedy continuations transformers + PEFT give -------
@pytest.fixture(scope="session")
def lora_base_dir(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    return build_random_model(tmp_path_factory.mktemp("lora_base"), "qwen2", tokenizer=False, seed=3)


@pytest.fixture(scope="session")
def lora_adapters(lora_base_dir, tmp_path_factory):
    """name -> (LoRARequest, greedy continuations of lora_helpers.PROMPTS by transformers + PEFT)."""
    from lora_helpers import ADAPTERS, PROMPTS, hf_greedy, make_peft_adapter

    from kubeinfer.engine import LoRARequest

    root = tmp_path_factory.mktemp("lora_adapters")
    out = {}
    for i, (name, config) in enumerate(ADAPTERS.items()):
        model = make_peft_adapter(lora_base_dir, root / name, seed=200 + i, scale=0.25, **config)
        out[name] = (LoRARequest(name, i + 1, str(root / name)), [hf_greedy(model, p) for p in PROMPTS])
    return out


@pytest.fixture(scope="session")
def lora_base_reference(lora_base_dir):
    from lora_helpers import PROMPTS, hf_greedy, load_hf

    model = load_hf(lora_base_dir)
    return [hf_greedy(model, p) for p in PROMPTS]


# -- A served llama ("tiny") and the official openai client on it, one per test module ----------------
@pytest.fixture(scope="module")
def server(llama_dir):
    from server_harness import RunningServer

    with RunningServer(llama_dir, name="tiny", block_size=8) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def references(hf_models):
    """transformers' greedy continuations, per family: references(family[, prompts, max_tokens])."""
    from test_engine_correctness import MAX_TOKENS, PROMPTS, hf_greedy

    cache = {}

    def get(family: str, prompts=PROMPTS, max_tokens=MAX_TOKENS):
        key = (family, id(prompts))
        if key not in cache:
            cache[key] = [hf_greedy(hf_models(family), p, n) for p, n in zip(prompts, max_tokens)]
        return cache[key]
    return get
