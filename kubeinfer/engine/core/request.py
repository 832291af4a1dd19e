"""A request inside the engine: its n sequences, and what happens to each sampled token.

`Completion.append_token` is the per-token output processing (vLLM's output processor): the token
joins its sequence, its logprobs are recorded, it is detokenized, and EOS, stop tokens, stop strings
and length decide whether the sequence is done. It comes in two parts, `add_token_id` (what the next
step needs) and `add_text` (what only the reader needs, unless stop strings are set), so that the engine
can run the second while the device computes the next step. `Request.to_output` is what callers see.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..sampling_params import SamplingParams
from ..sequence import Sequence
from .detokenizer import IncrementalDetokenizer, StopStringMatcher
from .outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class Completion:
    """Per-sequence text state: what was decoded, and how much of it may be shown."""
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    stops: StopStringMatcher
    text: str = ""

    def append_token(self, token: int, logprob, now: float, *, max_model_len: int,
                     token_text: Callable[[int], str | None]) -> str | None:
        """Adds a sampled token; returns the finish reason ("stop" / "length") when the sequence is done.
        `logprob` is the sampler's (chosen logprob, rank, top [(token, logprob)]) or None."""
        reason = self.add_token_id(token, logprob, now, max_model_len=max_model_len)
        return self.add_text(token, logprob, reason, token_text=token_text)

    def add_token_id(self, token: int, logprob, now: float, *, max_model_len: int) -> str | None:
        """The part of `append_token` the next step depends on: the token joins its sequence (and its grammar),
        and EOS, stop tokens, a finished grammar or the length say whether the sequence is done."""
        seq, params = self.seq, self.seq.params
        seq.append_token(token)
        if seq.grammar is not None and not seq.grammar.accept(token):
            raise ValueError(f"structured output: token {token} breaks the grammar ({seq.grammar.error})")
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        if logprob is not None:
            seq.cumulative_logprob += logprob[0]
        may_stop = seq.num_output_tokens >= params.min_tokens
        if may_stop and token in params.eos_token_ids:
            return "stop"
        if may_stop and token in params.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        if seq.grammar is not None and seq.grammar.is_finished:
            return "stop"  # the document is complete: only EOS could follow
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
            return "length"
        return None

    def add_text(self, token: int, logprob, reason: str | None, *, token_text: Callable[[int], str | None]) -> str | None:
        """The text part, after `add_token_id` gave `reason`: logprob entries with their tokens' text,
        detokenizing, and stop strings, which may end the sequence here (the reason returned then says so).
        Only a request with stop strings needs this before its next step (see output_processor: deferred text)."""
        seq = self.seq
        if logprob is not None:
            chosen, rank, top = logprob
            entry = {t: Logprob(lp, r + 1, token_text(t)) for r, (t, lp) in enumerate(top)}
            entry[token] = Logprob(chosen, rank, token_text(token))
            seq.logprobs.append(entry)
        full_text, new_chars = "", 0
        if self.detokenizer is not None:
            new_chars = len(self.detokenizer.add_token(token))
            if reason is not None:
                new_chars += len(self.detokenizer.flush())
            full_text = self.detokenizer.text
        if seq.num_output_tokens >= seq.params.min_tokens:
            match = self.stops.find(full_text, new_chars)
            if match is not None:  # a stop string wins over a length stop in the same token
                (seq.stop_reason, end), reason = match, "stop"
                full_text = full_text[:end]
        self.text = full_text if reason is not None else full_text[:self.stops.safe_length(full_text)]
        return reason

    def to_output(self) -> CompletionOutput:
        seq = self.seq
        return CompletionOutput(index=seq.index, text=self.text, token_ids=seq.output_token_ids,
                                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                                logprobs=seq.logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[Completion] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)

    def to_output(self) -> RequestOutput:
        first = self.completions[0].seq
        seqs = [c.seq for c in self.completions]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [c.to_output() for c in self.completions],
                             finished=self.finished, num_cached_tokens=first.num_cached_tokens,
                             metrics={"arrival_time": self.arrival_time,
                                      "first_scheduled_time": first.first_scheduled_time,
                                      "first_token_time": min((s.first_token_time for s in seqs
                                                               if s.first_token_time is not None), default=None),
                                      "last_token_time": max((s.last_token_time or 0) for s in seqs),
                                      "num_preemptions": sum(s.num_preemptions for s in seqs)},
                             error=next((s.error for s in seqs if s.error), None))


def prompt_tokens(prompt, tokenize: Callable[[str], list[int]], vocab: int) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt given as text, token ids, or {"prompt" | "prompt_token_ids": ...}."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        token_ids = tokenize(prompt)
        outside = [t for t in token_ids if t >= vocab]  # a token added to the tokenizer, not to the model
        if outside:
            raise ValueError(f"prompt: the tokenizer gives token id {outside[0]}, outside the model's vocabulary "
                             f"of {vocab} (a token added to the tokenizer that the model has no embedding for)")
        return prompt, token_ids
    token_ids = list(prompt)
    if not token_ids:
        raise ValueError("prompt must not be empty")
    if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
    return None, token_ids


def check_prompt_length(num_prompt_tokens: int, params: SamplingParams, max_model_len: int, kv_capacity: int) -> None:
    """ValueError unless the prompt leaves room to generate and prompt + max_tokens fits the context and the
    whole KV cache (`kv_capacity` tokens); an unset max_tokens becomes what the context leaves."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(f"prompt has {num_prompt_tokens} tokens; the model's context (max_model_len) is "
                         f"{max_model_len}, which leaves no room to generate")
    if params.max_tokens is None:
        params.max_tokens = max_model_len - num_prompt_tokens
    total = num_prompt_tokens + params.max_tokens
    if total > max_model_len:
        raise ValueError(f"max_tokens: prompt ({num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) "
                         f"is {total}, over the model's context of {max_model_len} tokens")
    if total > kv_capacity:
        raise ValueError(f"max_tokens: prompt plus max_tokens is {total} tokens, more than the whole KV cache "
                         f"holds ({kv_capacity}); lower max_tokens or raise num_kv_blocks")
