"""The routes the gateway takes from clients, in one table: the proxy and the ext_proc server both ask it.

Only inference goes through: what a client may ask of an engine is generating text and reading the model
list. Everything else an engine serves (adapter loading, metrics, health, load reports, tokenizer and
debug routes) is for the platform, and the gateway answers it itself: 403 for adapter management, which
the operator owns (an InferenceModel's `spec.adapters`), 404 in OpenAI's shape for the rest, including a
known path with another method. Paths are matched exactly (no prefix, no trailing slash, no decoding),
so nothing reaches an engine that this table does not name.
"""
from __future__ import annotations

from dataclasses import dataclass

# POST routes whose JSON body names a `model`: routed by the picker, admitted and accounted per tenant.
INFERENCE_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
MODELS_ROUTE = "/v1/models"  # GET, and GET /v1/models/{id}: answered from the engines' cards
ADAPTER_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
ADAPTER_MESSAGE = ("adapters are loaded by the operator, not through the gateway: list them in the InferenceModel's "
                   "spec.adapters")


@dataclass(frozen=True)
class Route:
    kind: str  # "inference", "models", "model" (one card) or "refused"
    status: int = 200  # for "refused": the status to answer
    message: str = ""


def route_of(method: str, path: str) -> Route:
    """What the gateway does with `method path` (the query string is ignored)."""
    method, path = method.upper(), path.partition("?")[0]
    if method == "POST" and path in INFERENCE_ROUTES:
        return Route("inference")
    if method == "GET" and path == MODELS_ROUTE:
        return Route("models")
    if method == "GET" and path.startswith(MODELS_ROUTE + "/") and len(path) > len(MODELS_ROUTE) + 1:
        return Route("model")
    if path in ADAPTER_ROUTES:
        return Route("refused", 403, ADAPTER_MESSAGE)
    return Route("refused", 404, f"{method} {path} is not a route of this API")
