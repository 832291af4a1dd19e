"""kubeinfer's inference engine: paged KV cache, continuous batching, prefix caching, sampling.

The public names are imported on first use, so that light modules of this package (the server's
argument parser, the adapter format) can be imported without torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {"LLM": ".llm", "LLMEngine": ".llm_engine", "EngineConfig": ".config", "LoRARequest": ".lora",
            "SamplingParams": ".sampling_params", "RequestOutput": ".outputs", "CompletionOutput": ".outputs",
            "Logprob": ".outputs"}
__all__ = ["LLM", "LLMEngine", "EngineConfig", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput",
           "Logprob"]

if TYPE_CHECKING:
    from .config import EngineConfig
    from .llm import LLM
    from .llm_engine import LLMEngine
    from .lora import LoRARequest
    from .outputs import CompletionOutput, Logprob, RequestOutput
    from .sampling_params import SamplingParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
