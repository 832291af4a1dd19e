"""OpenAI API request bodies (plus vLLM's extra sampling fields), validated before any model work.

A request field is honoured or refused with a 400, never accepted and ignored. Pydantic checks types
and ranges; `sampling_params` maps a body onto SamplingParams, whose own checks name the offending
field. Known fields this server does not implement (beam search, bad_words...) are
refused unless their value asks for nothing. Fields nobody declares are ignored, as OpenAI
and vLLM do, but named in a warning, as vLLM does.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator, model_validator

from ...sampling_params import SamplingParams
from .chat_messages import ChatMessage, check_template_kwargs
from .protocol_base import NOT_YET, RequestModel, Trivial, one_of, unset, warn_about_ignored_fields
from .structured import structured_outputs_of

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk (guidellm sends it)
    include_obfuscation: Any = None  # no effect on what is generated


def best_of_is_n(value: Any, fields: dict) -> bool:
    return value is None or value == fields.get("n", 1)


# Refused in completions and chat unless trivial.
REFUSED_SHARED: dict[str, tuple[Trivial, str]] = {
    "best_of": (best_of_is_n, "not supported: every sequence generated is returned, so best_of must equal n"),
    "structural_tag": (unset, NOT_YET + ": use response_format or structured_outputs"),
    "bad_words": (unset, NOT_YET + "; to ban single tokens, give their ids a logit_bias of -100"),
    "use_beam_search": (unset, NOT_YET), "logits_processors": (unset, NOT_YET), "prompt_logprobs": (unset, NOT_YET),
    "truncate_prompt_tokens": (unset, NOT_YET), "return_tokens_as_token_ids": (unset, NOT_YET),
    "spaces_between_special_tokens": (one_of(True), NOT_YET + "; only true"),
    "cache_salt": (unset, NOT_YET), "kv_transfer_params": (unset, NOT_YET), "vllm_xargs": (unset, NOT_YET),
    "mm_processor_kwargs": (unset, NOT_YET + ": the models served take text only"),
}


class SamplingExtras(RequestModel):
    """The sampling fields that chat completions, completions and responses share, vLLM's extras among
    them (guidellm sends ignore_eos to all three)."""
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    logit_bias: dict[int, float] | None = None  # JSON's string keys become token ids; SamplingParams checks values
    allowed_token_ids: list[int] | None = None
    # vLLM's structured output fields (structured.py reads them, with response_format, into one constraint)
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class SamplingFields(SamplingExtras):
    """Fields shared by completions and chat completions."""
    refused = REFUSED_SHARED

    model: str
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted: they do not change what is generated.
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    response_format: Any = None  # OpenAI's structured output (structured.py)
    # Refused unless trivial (`refused`); declared so that the 400 names them.
    best_of: Any = None
    structural_tag: Any = None
    bad_words: Any = None
    use_beam_search: Any = None
    logits_processors: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    spaces_between_special_tokens: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _warn_about_ignored_fields(self):
        warn_about_ignored_fields(self)
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, repetition_penalty=self.repetition_penalty or 1.0,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty, seed=self.seed,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=self.min_tokens, logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids, structured_outputs=structured_outputs_of(self))


class CompletionRequest(SamplingFields):
    refused = {**REFUSED_SHARED, "echo": (unset, NOT_YET), "suffix": (lambda v, _: not v, NOT_YET),
               "prompt_embeds": (unset, NOT_YET),
               "add_special_tokens": (one_of(True), NOT_YET + "; only true (the tokenizer adds them)")}

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    return_token_ids: bool = False
    echo: Any = None
    suffix: Any = None
    prompt_embeds: Any = None
    add_special_tokens: Any = None

    @model_validator(mode="after")
    def _check_prompt(self):
        prompts = self.prompts()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]
        return list(p)


class ChatCompletionRequest(SamplingFields):
    refused = {**REFUSED_SHARED,
               "functions": (unset, "deprecated by OpenAI: use tools"),
               "function_call": (one_of("none"), "deprecated by OpenAI: use tool_choice"),
               "audio": (unset, NOT_YET + ": text only"), "modalities": (one_of(["text"]), NOT_YET + ': only ["text"]'),
               "prediction": (unset, NOT_YET), "verbosity": (unset, NOT_YET),
               "web_search_options": (unset, NOT_YET), "echo": (unset, NOT_YET),
               "continue_final_message": (unset, NOT_YET), "chat_template": (unset, NOT_YET),
               "documents": (unset, NOT_YET),
               "add_special_tokens": (one_of(False), NOT_YET + "; only false (the chat template writes them)")}

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling (tool_calls.ToolPlan reads them)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Refused unless trivial (`refused`); declared so that the 400 names them.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None  # passed to templates that read it (gpt-oss); else a 400 (serving_chat)
    verbosity: Any = None
    web_search_options: Any = None
    echo: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    documents: Any = None
    add_special_tokens: Any = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _plain_template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        check_template_kwargs(kwargs or {})
        return kwargs

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class LoadLoRARequest(BaseModel):
    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoRARequest(BaseModel):
    lora_name: Annotated[str, Field(min_length=1)]
