"""The OpenAI-compatible HTTP API of an engine pod (FastAPI): the app and its routes. Completions, chat
completions and responses (serving_completion, serving_chat, serving_responses; streamed as SSE or
not), /v1/models, /health,
/version, /metrics and the LoRA adapter routes (lora_routes).

Every request is validated and tokenized before it reaches the engine; errors use OpenAI's shape
(errors.py). A client that goes away mid-request cancels it, which aborts it in the engine and frees
its blocks. `model` names the base model or one of the loaded LoRA adapters.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kubeinfer import __version__
from kubeinfer.common.http_guard import GuardConfig, RequestGuard

from ..load_report import add_load_route
from ..request_budget import TIMEOUT_HEADER
from ..request_limits import check_timeout_header
from .errors import APIError, error_response
from .json_body import OffLoopJSONRoute
from .lora_routes import add_lora_routes
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses_protocol import ResponsesRequest
from .server_state import ServerState
from .serving_chat import create_chat_completion
from .serving_completion import create_completion
from .serving_responses import create_response

__all__ = ["ServerState", "build_app"]


# Open without the API key: probes, scrapers and `kubeinfer` version checks. Everything else (the API,
# /load, the OpenAPI schema and docs) takes the key when one is set.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


def build_app(state: ServerState, guard: GuardConfig | None = None) -> FastAPI:
    """The app, behind RequestGuard (body size and time, requests in flight: `guard`, default limits)."""
    app = FastAPI(title="kubeinfer engine", version=__version__,
                  description="OpenAI-compatible API of one kubeinfer engine pod")
    app.router.route_class = OffLoopJSONRoute
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError):
        return error_response(error.status, error.message, error.param, error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException):
        """Unknown routes and methods answer in OpenAI's error shape too, not FastAPI's {"detail": ...}."""
        return error_response(error.status_code, str(error.detail), headers=getattr(error, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(location) or None
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('msg', '')}")
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        return error_response(400, f"{param}: {message}" if param else message, param)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if request.url.path not in OPEN_PATHS and not state.authorized(request.headers.get("authorization", "")):
            return error_response(401, "invalid or missing API key (send 'Authorization: Bearer KEY')")
        if request.method == "POST":  # the time budget is refused before admission, never after it
            try:
                check_timeout_header(request.headers)
            except ValueError as error:
                return error_response(400, str(error), TIMEOUT_HEADER)
        return await call_next(request)

    @app.get("/health")
    async def health():
        """200 only when a request sent now can be served: not draining, the loop alive, the engine not dead."""
        engine = state.async_engine
        if state.draining:
            return error_response(503, "draining: this server is shutting down")
        if engine.death is not None:
            return error_response(503, f"the engine is dead: {engine.death}")
        if not engine.is_running:
            return error_response(503, "the engine is not running")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_cards() -> list[dict]:
        def card(name: str, root: str, parent: str | None) -> dict:
            return {"id": name, "object": "model", "created": state.created, "owned_by": "kubeinfer", "root": root,
                    "parent": parent, "max_model_len": state.engine.max_model_len}

        adapters = [card(r.lora_name, r.lora_path, state.served_model_name) for r in state.engine.list_loras()]
        return [card(state.served_model_name, state.model_path, None), *adapters]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": model_cards()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        found = next((card for card in model_cards() if card["id"] == model_id), None)
        if found is None:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model")
        return found

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state, body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await create_response(state, body, request)

    add_lora_routes(app, state)
    add_load_route(app, state)
    # Added last, so outermost: a body over the limit is refused (and its connection closed) before anything
    # else, the key check included, looks at the request.
    app.add_middleware(RequestGuard, config=guard or GuardConfig())
    return app
