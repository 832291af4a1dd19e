"""The offline API, as in vLLM: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from ..config import EngineConfig
from ..core.llm_engine import LLMEngine
from ..core.outputs import RequestOutput
from ..lora.request import LoRARequest
from ..sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, device: str = "cpu", dtype: str | None = None, max_model_len: int | None = None,
                 max_num_seqs: int = 64, block_size: int = 16, num_kv_blocks: int | None = None,
                 enable_prefix_caching: bool = True, enable_lora: bool = False, max_loras: int = 4,
                 max_lora_rank: int = 64, max_cpu_loras: int | None = None, seed: int = 0,
                 tensor_parallel_size: int = 1, **kwargs) -> None:
        """`tensor_parallel_size`: ranks (processes, one per GPU on CUDA) the model is split across; this process
        is rank 0 and starts the others. `shutdown()` (or the end of the process) ends them."""
        config = EngineConfig(model=str(model), device=device, dtype=dtype, max_model_len=max_model_len,
                              max_num_seqs=max_num_seqs, block_size=block_size, num_kv_blocks=num_kv_blocks,
                              enable_prefix_caching=enable_prefix_caching, enable_lora=enable_lora,
                              max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                              seed=seed, tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.engine = LLMEngine(config)
        self._next_id = 0

    def shutdown(self) -> None:
        """End the tensor-parallel ranks this LLM started (a no-op on one device)."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 lora_request: LoRARequest | list[LoRARequest] | None = None) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        for lora in dict.fromkeys(lora for lora in loras if lora is not None):
            self.engine.add_lora(lora)  # as in vLLM: an adapter is read and validated on its first use
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                request_id = str(self._next_id)
                self._next_id += 1
                # SamplingParams is mutated with engine defaults; keep the caller's object intact.
                self.engine.add_request(request_id, prompt, _copy(p), lora_id=lora.lora_int_id if lora else 0)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[i] for i in ids]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block no request holds (vLLM's LLM.reset_prefix_cache)."""
        self.engine.reset_prefix_cache()
        return True

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": _token_ids(tokenizer.apply_chat_template(
            c, add_generation_prompt=add_generation_prompt, tokenize=True))} for c in conversations]
        return self.generate(prompts, sampling_params, lora_request)


def _token_ids(encoded) -> list[int]:
    # apply_chat_template returns a list, or a BatchEncoding in newer transformers
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _copy(params: SamplingParams) -> SamplingParams:
    import copy
    return copy.copy(params)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _per_prompt(value, count: int, name: str) -> list:
    if isinstance(value, SequenceABC) and not isinstance(value, str):
        if len(value) != count:
            raise ValueError(f"{name}: got {len(value)} values for {count} prompts")
        return list(value)
    return [value] * count
