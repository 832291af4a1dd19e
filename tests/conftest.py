"""Shared fixtures: tiny random-init Hugging Face models of each supported family, built once per session."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    from kubeinfer.engine.random_model import FAMILIES, build_random_model

    root = tmp_path_factory.mktemp("models")
    return {family: str(build_random_model(root / family, family, seed=i)) for i, family in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def hf_models(model_dirs):
    """The transformers reference implementation of each family, loaded from the same directory."""
    import torch
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = AutoModelForCausalLM.from_pretrained(model_dirs[family], dtype=torch.float32).eval()
        return cache[family]
    return get
