"""kubeinfer's inference engine: paged KV cache, continuous batching, prefix caching, sampling."""
from .llm import LLM
from .llm_engine import LLMEngine
from .config import EngineConfig
from .lora import LoRARequest
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "LoRARequest", "SamplingParams", "RequestOutput",
           "CompletionOutput", "Logprob"]
