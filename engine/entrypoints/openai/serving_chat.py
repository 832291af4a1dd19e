"""`POST /v1/chat/completions`: messages (and tools) rendered by the model's chat template, `chat.completion`
objects (or `chat.completion.chunk` deltas) out, with tool calls as tool_calls.ToolPlan decides."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from ...core.outputs import RequestOutput
from .errors import APIError, param_of
from .protocol import ChatCompletionRequest
from .server_state import ServerState
from .serving_engine import check_serving, prepare_all, respond, to_params
from .streaming import usage
from .tool_calls import ToolPlan, tool_call_json
from .tool_stream import ToolStream


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request):
    lora_id = check_serving(state, body)
    params = to_params(body, body.effective_max_tokens(), body.logprobs_count())
    tools = tool_plan(state, body, params)
    # The template is rendered and tokenized on the tokenizer thread, with the rest of the preparation.
    prepared = await prepare_all(state, body, lambda: [{"prompt_token_ids": chat_prompt(state, body, tools)}], params,
                                 "chatcmpl", lora_id)
    return await respond(state, request, body, prepared,
                         ChatFormat(body.model, body.logprobs, body.top_logprobs or 0, tools))


def tool_plan(state: ServerState, body: ChatCompletionRequest, params) -> ToolPlan | None:
    """How the request calls tools; a constrained choice (required, named) becomes the output's grammar."""
    try:
        plan = ToolPlan.of(body, state.tool_call_parser)
    except ValueError as error:
        raise APIError(400, str(error), param_of(str(error)) or "tools") from error
    constraint = plan.constraint() if plan else None
    if constraint is not None:
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice: a required or named tool call cannot be combined with "
                                f"{params.structured_outputs.field}", "tool_choice")
        params.structured_outputs = constraint
    return plan


def chat_prompt(state: ServerState, body: ChatCompletionRequest, tools: ToolPlan | None = None) -> list[int]:
    tokenizer = state.engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    try:
        messages = [m.for_template() for m in body.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                             tools=tools.tools if tools else None, tokenize=False,
                                             **(body.chat_template_kwargs or {}))
    except ValueError as error:
        raise APIError(400, str(error), "messages") from error
    except Exception as error:  # a template error is the request's fault (bad roles, order...)
        raise APIError(400, f"messages: the chat template failed: {error}", "messages") from error
    # The template writes the special tokens itself; adding them again would double the BOS.
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass
class ChatFormat:
    model: str
    logprobs: bool
    top_logprobs: int = 0
    tools: ToolPlan | None = None
    tool_streams: dict[int, ToolStream] = field(default_factory=dict)  # per streamed choice

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    def _logprobs(self, completion, token_from: int) -> dict | None:
        if not self.logprobs or completion.logprobs is None:
            return None

        def item(text: str | None, logprob: float) -> dict:
            text = text or ""
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for token, entry in zip(completion.token_ids[token_from:], completion.logprobs[token_from:]):
            chosen = entry[token]
            top = [item(lp.decoded_token, lp.logprob) for lp in sorted(entry.values(), key=lambda lp: lp.rank)
                   if lp.rank <= self.top_logprobs]
            content.append({**item(chosen.decoded_token, chosen.logprob), "top_logprobs": top})
        return {"content": content}

    def _reply(self, completion) -> tuple[dict, str | None]:
        """The assistant's message (content, tool calls) and the finish reason OpenAI would give."""
        if self.tools is None:
            return {"role": "assistant", "content": completion.text}, completion.finish_reason
        content, calls = self.tools.extract(completion.text)
        message = {"role": "assistant", "content": content}
        if not calls:
            return message, completion.finish_reason
        message["tool_calls"] = [tool_call_json(call) for call in calls]
        return message, "tool_calls" if completion.finish_reason == "stop" else completion.finish_reason

    def full_response(self, request_id: str, outputs: list[RequestOutput], n: int) -> dict:
        output = outputs[0]
        choices = []
        for c in output.outputs:
            message, finish_reason = self._reply(c)
            choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(c, 0),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": self.model,
                "choices": choices, "usage": usage(outputs)}

    def _chunk(self, request_id: str, choices: list[dict]) -> dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model,
                "choices": choices}

    def role_chunk(self, request_id: str, count: int) -> dict:
        return self._chunk(request_id, [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                         "finish_reason": None} for i in range(count)])

    def chunk(self, request_id, index, text, completion, token_from, text_from) -> dict | None:
        if self.tools is not None:  # content and calls as tool_stream reads them from the reply so far
            stream = self.tool_streams.setdefault(index, ToolStream(self.tools))
            delta = stream.update(completion.text, bool(completion.finish_reason))
            if delta is None and not completion.finish_reason:
                return None
            finish_reason = completion.finish_reason
            if stream.called and finish_reason == "stop":
                finish_reason = "tool_calls"
            return self._chunk(request_id, [{"index": index, "delta": delta or {}, "logprobs": None,
                                             "finish_reason": finish_reason, "stop_reason": completion.stop_reason}])
        delta = {"content": text} if text else {}
        return self._chunk(request_id, [{"index": index, "delta": delta, "logprobs": self._logprobs(completion, token_from),
                                         "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}])

    def usage_chunk(self, request_id, outputs) -> dict:
        return {**self._chunk(request_id, []), "usage": usage(outputs)}
