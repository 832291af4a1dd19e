"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, raised as APIError
anywhere in a handler and rendered by the app's exception handler."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from kubeinfer.common.http_guard import bounded_message, clip

RETRY_AFTER_SECONDS = 1
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
               429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
# SamplingParams / engine messages start with the field they are about.
KNOWN_PARAMS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                "presence_penalty", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs", "prompt",
                "priority", "messages", "logit_bias", "allowed_token_ids", "response_format", "structured_outputs",
                "guided_json", "guided_regex", "guided_choice", "guided_grammar", "tools", "tool_choice")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


MAX_PARAM_CHARS = 128


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    message, param = bounded_message(message), param if param is None else clip(param, MAX_PARAM_CHARS)
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"), "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def param_of(message: str) -> str | None:
    word = message.split(" ", 1)[0].rstrip(":")
    return word if word in KNOWN_PARAMS else None


def engine_unavailable(error: Exception) -> APIError:
    """The engine died or is going away: 503, so that clients and gateways retry on another replica."""
    return APIError(503, str(error), headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
