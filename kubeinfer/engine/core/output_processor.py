"""What happens to a step's sampled tokens (vLLM's output processor): each joins its sequence, is
detokenized and checked against the stop conditions, and the requests that moved get their outputs.

Deferred text (`async_output_processing`, on by default on CUDA; vLLM's async output processing): the
next step needs only the new token ids and whether each sequence ended by EOS, a stop token, a finished
grammar or its length (`Completion.add_token_id`). Detokenizing, logprob texts and building the outputs
(`Completion.add_text`) can wait: the engine launches the next step first and then calls
`deferred_outputs`, while the device computes. A request with stop strings is the exception: its text
decides where it ends, so its text work stays in its own step. On a CPU the forward runs on the engine
thread, nothing overlaps and outputs would only leave a forward pass later: off there.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from ..model_executor.sampler import SampleResult
from ..sequence import Sequence
from .outputs import RequestOutput
from .request import Completion, Request
from .scheduler import Scheduler

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, requests: dict[str, Request], *, max_model_len: int,
                 token_text: Callable[[int], str | None], after_outputs: Callable[[], None], defer_text: bool) -> None:
        self.scheduler = scheduler
        self.requests = requests  # the engine's live requests: a finished one is removed once its output is built
        self.max_model_len = max_model_len
        self.token_text = token_text
        self.after_outputs = after_outputs  # e.g. retire adapters nothing uses any more
        self.defer_text = defer_text
        self.num_prompt_tokens = 0  # prompt tokens of requests that produced their first token
        self.num_generation_tokens = 0
        self._deferred: list[tuple[Request, Completion, int, object, str | None]] = []

    @property
    def has_deferred(self) -> bool:
        return bool(self._deferred)

    def add_step(self, sampled_seqs: list[Sequence], result: SampleResult, now: float,
                 mark: Callable[[str], None] = lambda phase: None) -> list[RequestOutput]:
        """Take a step's tokens; the outputs of the requests whose text was done now (not deferred). A sequence
        that fails alone (its grammar, its text) ends its request with the error. `mark("outputs")` is called
        before the outputs are built (the step timer's phases)."""
        touched: dict[str, Request] = {}
        broken: dict[str, str] = {}
        for i, seq in enumerate(sampled_seqs):
            request = self.requests.get(seq.request_id)
            if request is None or seq.is_finished:
                continue
            # Deferred only if this step was queued without a wait (the next one likely will be too, so its text
            # work has a forward pass to hide behind), and never with stop strings (the text decides the end).
            defer = self.defer_text and result.async_copy and not request.params.stop
            try:
                for token, logprob in result.tokens(i):  # with speculative decoding, accepted drafts first
                    self._add_token(request, seq, token, logprob, now, defer)
                    self.num_generation_tokens += 1
                    if seq.is_finished:  # a stop or the length: the tokens after it are dropped
                        break
                if seq.spec_token_ids:
                    self.scheduler.accept_drafts(seq, len(result.accepted[i]))
            except Exception as error:  # e.g. the tokenizer cannot decode it: this request alone ends
                logger.exception("request %s failed after a step", seq.request_id)
                broken[seq.request_id] = f"{type(error).__name__}: {error}"
                continue
            if not defer:
                touched[request.request_id] = request
        mark("outputs")
        return self.fail(set(broken), broken) + self.finish(touched)

    def _add_token(self, request: Request, seq: Sequence, token: int, logprob, now: float, defer: bool) -> None:
        if seq.first_token_time is None and seq.index == 0:
            self.num_prompt_tokens += seq.num_prompt_tokens
        completion = request.completions[seq.index]
        if defer:
            reason = completion.add_token_id(token, logprob, now, max_model_len=self.max_model_len)
            self._deferred.append((request, completion, token, logprob, reason))
        else:
            reason = completion.append_token(token, logprob, now, max_model_len=self.max_model_len,
                                             token_text=self.token_text)
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def deferred_outputs(self) -> list[RequestOutput]:
        """The text work of the deferred tokens, in order; the outputs of the requests it touched. A request
        that fails here (its tokenizer cannot decode) ends alone, with the error."""
        entries, self._deferred = self._deferred, []
        touched: dict[str, Request] = {}
        broken: dict[str, str] = {}
        for request, completion, token, logprob, reason in entries:
            if request.request_id in broken or self.requests.get(request.request_id) is not request:
                continue  # failed above, or aborted since
            try:
                completion.add_text(token, logprob, reason, token_text=self.token_text)
            except Exception as error:
                logger.exception("request %s failed after a step", request.request_id)
                broken[request.request_id] = f"{type(error).__name__}: {error}"
                touched.pop(request.request_id, None)
                continue
            touched[request.request_id] = request
        return self.fail(set(broken), broken) + self.finish(touched)

    def fail(self, request_ids: set[str], errors: dict[str, str | None]) -> list[RequestOutput]:
        """End every sequence of these requests with finish reason "abort" and the error; their final outputs
        (after the text still deferred, so that text and token ids agree)."""
        outputs = self.deferred_outputs() if request_ids and self._deferred else []
        ended = {}
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            for completion in request.completions:
                self.scheduler.finish(completion.seq, "abort", errors.get(request_id) or "the engine gave up on it")
            ended[request_id] = request
        return outputs + self.finish(ended)

    def finish(self, touched: dict[str, Request]) -> list[RequestOutput]:
        """The outputs of these requests; the finished ones leave `requests`."""
        outputs = [r.to_output() for r in touched.values()]
        for r in touched.values():
            if r.finished:
                del self.requests[r.request_id]
        self.after_outputs()
        return outputs
