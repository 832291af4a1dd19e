"""`POST /v1/completions`: one or more prompts (text or token ids) in, `text_completion` objects out."""
from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import Request

from ...core.outputs import RequestOutput
from .protocol import CompletionRequest
from .server_state import ServerState
from .serving_engine import check_serving, prepare_all, respond, to_params
from .streaming import usage


async def create_completion(state: ServerState, body: CompletionRequest, request: Request):
    lora_id = check_serving(state, body)
    params = to_params(body, body.max_tokens, body.logprobs)
    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in body.prompts()]
    prepared = await prepare_all(state, body, prompts, params, "cmpl", lora_id)
    return await respond(state, request, body, prepared, CompletionFormat(body.model, body.logprobs,
                                                                          body.return_token_ids))


@dataclass
class CompletionFormat:
    model: str
    logprobs: int | None
    return_token_ids: bool = False  # vLLM's extension: the prompt's and the completion's token ids

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def _logprobs(self, completion, token_from: int, text_offset: int) -> dict | None:
        if self.logprobs is None or completion.logprobs is None:
            return None
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = text_offset
        for token, entry in zip(completion.token_ids[token_from:], completion.logprobs[token_from:]):
            chosen = entry[token]
            text = chosen.decoded_token or ""
            result["tokens"].append(text)
            result["token_logprobs"].append(chosen.logprob)
            result["top_logprobs"].append({lp.decoded_token or "": lp.logprob for lp in entry.values()})
            result["text_offset"].append(offset)
            offset += len(text)
        return result

    def choice(self, index: int, text: str, completion, token_from: int = 0, text_offset: int = 0,
               prompt_token_ids: list[int] | None = None) -> dict:
        choice = {"index": index, "text": text, "logprobs": self._logprobs(completion, token_from, text_offset),
                  "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
        if self.return_token_ids:
            choice["token_ids"] = completion.token_ids[token_from:]
            choice["prompt_token_ids"] = prompt_token_ids if token_from == 0 else None
        return choice

    def full_response(self, request_id: str, outputs: list[RequestOutput], n: int) -> dict:
        choices = [self.choice(i * n + c.index, c.text, c, prompt_token_ids=o.prompt_token_ids)
                   for i, o in enumerate(outputs) for c in o.outputs]
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": choices, "usage": usage(outputs)}

    def chunk(self, request_id, index, text, completion, token_from, text_from) -> dict:
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": [self.choice(index, text, completion, token_from, text_from)]}

    def usage_chunk(self, request_id, outputs) -> dict:
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": [], "usage": usage(outputs)}
