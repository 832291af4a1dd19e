"""kubeinfer's inference engine: paged KV cache, continuous batching, prefix caching, sampling, multi-LoRA.

Layers, each importing only those below it (tests/engine/test_engine_layout.py checks it, and that no module
imports in a cycle):

    entrypoints/      offline LLM, `kubeinfer serve`, OpenAI HTTP API, gRPC API, Prometheus metrics
    core/             engine loop, async engine, scheduler, block manager, detokenizer, outputs
    spec_decode/      speculative decoding: config, n-gram proposer, rejection sampler, adaptive switch
    model_executor/   model runner, loader, CUDA graphs, sampler, layers/ (+ Triton kernels), models/
    lora/             adapter files, device pool, manager, LoRA layers and kernels, placement
    config, sampling_params, sequence, triton_utils
                      what every layer shares: the user's and the checkpoint's configuration, a
                      request's sampling parameters, a sequence and a step's batch, Triton helpers

The public names are imported on first use, so that light modules of this package (the server's
argument parser, the adapter format) can be imported without torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {"LLM": ".entrypoints.llm", "LLMEngine": ".core.llm_engine", "EngineConfig": ".config",
            "LoRARequest": ".lora.request", "SamplingParams": ".sampling_params", "RequestOutput": ".core.outputs",
            "CompletionOutput": ".core.outputs", "Logprob": ".core.outputs"}
__all__ = ["LLM", "LLMEngine", "EngineConfig", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput",
           "Logprob"]

if TYPE_CHECKING:
    from .config import EngineConfig
    from .core.llm_engine import LLMEngine
    from .core.outputs import CompletionOutput, Logprob, RequestOutput
    from .entrypoints.llm import LLM
    from .lora.request import LoRARequest
    from .sampling_params import SamplingParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
