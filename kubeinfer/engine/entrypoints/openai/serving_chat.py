"""`POST /v1/chat/completions`: messages (and tools) rendered by the model's chat template, `chat.completion`
objects (or `chat.completion.chunk` deltas) out, with tool calls as tool_calls.ToolPlan decides."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from ...core.outputs import RequestOutput
from .errors import APIError, param_of
from .protocol import ChatCompletionRequest
from .reasoning_parsers import ReasoningParser, ReasoningStream
from .server_state import ServerState
from .serving_engine import check_serving, prepare_all, respond, to_params
from .streaming import usage
from .tool_calls import ToolPlan, tool_call_json
from .tool_parsers import KEEPS_SPECIAL_TOKENS
from .tool_stream import ToolStream, final_reply


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request):
    lora_id = check_serving(state, body)
    params = to_params(body, body.effective_max_tokens(), body.logprobs_count())
    tools = tool_plan(state, body, params)
    # The template is rendered and tokenized on the tokenizer thread, with the rest of the preparation.
    prepared = await prepare_all(state, body, lambda: [{"prompt_token_ids": chat_prompt(state, body, tools)}], params,
                                 "chatcmpl", lora_id)
    return await respond(state, request, body, prepared,
                         ChatFormat(body.model, body.logprobs, body.top_logprobs or 0, tools, state.reasoning_parser))


def tool_plan(state: ServerState, body: ChatCompletionRequest, params) -> ToolPlan | None:
    """How the request calls tools; a constrained choice (required, named) becomes the output's grammar."""
    try:
        plan = ToolPlan.of(body, state.tool_call_parser)
    except ValueError as error:
        raise APIError(400, str(error), param_of(str(error)) or "tools") from error
    if plan is not None and plan.parser in KEEPS_SPECIAL_TOKENS:
        params.skip_special_tokens = False  # the format's tag is a special token
    if getattr(state.reasoning_parser, "keeps_special_tokens", False):
        params.skip_special_tokens = False  # harmony's channel headers are special tokens (gpt_oss)
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
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:  # OpenAI's field; a template that reads it decides what it means
        if "reasoning_effort" not in str(tokenizer.chat_template):
            raise APIError(400, "reasoning_effort: this model's chat template has no reasoning effort", "reasoning_effort")
        kwargs["reasoning_effort"] = body.reasoning_effort
    try:
        messages = [m.for_template() for m in body.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                             tools=tools.tools if tools else None, tokenize=False, **kwargs)
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
    reasoning: ReasoningParser | None = None
    # per streamed choice: what was sent of its calls, of its reasoning, of its content
    tool_streams: dict[int, ToolStream] = field(default_factory=dict)
    reasoning_streams: dict[int, ReasoningStream] = field(default_factory=dict)
    content_sent: dict[int, int] = field(default_factory=dict)

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
        """The assistant's message (content, reasoning, tool calls) and the finish reason OpenAI would give."""
        message: dict = {"role": "assistant", "content": completion.text}
        if self.reasoning is not None:
            reasoning, message["content"] = self.reasoning.split(completion.text, True)
            message["reasoning"] = message["reasoning_content"] = reasoning or None  # vLLM's new and old names
        if self.tools is None:
            return message, completion.finish_reason
        message["content"], calls = final_reply(self.tools, message["content"], completion.finish_reason)
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
        finished, finish_reason = bool(completion.finish_reason), completion.finish_reason
        delta: dict = {}
        content, new_content = completion.text, None
        if self.reasoning is not None:  # thinking as it comes; the answer after it is the content
            reasoning_stream = self.reasoning_streams.get(index)
            if reasoning_stream is None:  # made once per choice, not once per delta
                reasoning_stream = self.reasoning_streams[index] = ReasoningStream(self.reasoning)
            reasoning, new_content = reasoning_stream.feed(text, finished)  # reads only the new text
            if reasoning:
                delta["reasoning"] = delta["reasoning_content"] = reasoning
            if self.tools is not None:
                content = reasoning_stream.content
        logprobs = None
        if self.tools is not None:  # content and calls as tool_stream reads them from the reply so far
            stream = self.tool_streams.setdefault(index, ToolStream(self.tools))
            delta.update(stream.update(content, finished) or {})
            if stream.called and finish_reason == "stop":
                finish_reason = "tool_calls"
        else:
            if new_content is None:
                sent = self.content_sent.get(index, 0)
                new_content = content[sent:]
                self.content_sent[index] = max(sent, len(content))
            if new_content:
                delta["content"] = new_content
            logprobs = self._logprobs(completion, token_from)
        if not delta and not finished and logprobs is None:
            return None
        return self._chunk(request_id, [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason, "stop_reason": completion.stop_reason}])

    def usage_chunk(self, request_id, outputs) -> dict:
        return {**self._chunk(request_id, []), "usage": usage(outputs)}
