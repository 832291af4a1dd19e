"""Proxy mode: the gateway as the HTTP front door, for clusters without Envoy and for local runs.

It takes only the routes of routes.py: it answers `GET /v1/models` and `/v1/models/{id}` with the cards
its endpoints publish (merged: each model once, as the engines describe it) and forwards the inference
POSTs (completions, chat completions, responses), streamed responses included, to the endpoint the
picker chose (forward.py: retries, timeouts, cancellation; relay.py: the engine's answer relayed intact); any
other path or method is answered here (404, or 403 for adapter management), never forwarded. Every
request's end is reported to its endpoint (`record_finish`), so the picker's load figures drop the
moment a response completes, not at the next scrape. Errors, unknown routes included, use OpenAI's
shape.
"""
from __future__ import annotations

from urllib.parse import unquote

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..datastore.endpoints import Endpoint
from .forward import Forwarder, error_response
from .routes import MODELS_ROUTE, route_of
from .routing import Router
from .upstream import ClientShards, UpstreamConfig


def model_cards(endpoints: list[Endpoint]) -> list[dict]:
    """Each served model once, with the card its engine gives (base models first). An adapter that is
    assigned but not loaded anywhere yet is listed too (requests for it go to the pods that load it),
    with what the gateway knows of it."""
    cards: dict[str, dict] = {}
    for endpoint in endpoints:
        for model_id in sorted(endpoint.models):
            card = endpoint.cards.get(model_id)
            if card is not None:
                cards.setdefault(model_id, dict(card))
    for endpoint in endpoints:
        base = next((cards[b] for b in sorted(endpoint.base_models) if b in cards), None)
        for model_id in sorted(endpoint.models | endpoint.placed_adapters):
            is_base = model_id in endpoint.base_models
            cards.setdefault(model_id, {
                "id": model_id, "object": "model", "created": base["created"] if base else 0,
                "owned_by": "kubeinfer", "root": None, "parent": None if is_base else (base or {}).get("id"),
                "max_model_len": (base or {}).get("max_model_len")})
    return sorted(cards.values(), key=lambda c: (c.get("parent") is not None, c["id"]))


ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def build_proxy_app(router: Router, client: httpx.AsyncClient | None = None,
                    upstream: UpstreamConfig | None = None) -> FastAPI:
    app = FastAPI(title="kubeinfer gateway", description="OpenAI-compatible front door over kubeinfer engines",
                  openapi_url=None)  # no docs routes: every path but /health goes through the route table
    upstream = upstream or UpstreamConfig()
    forwarder = Forwarder(router, ClientShards(upstream, client), upstream)
    picker = router.picker

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException):
        """Any error Starlette raises itself answers in OpenAI's shape, as the engines do, not FastAPI's."""
        response = error_response(error.status_code, str(error.detail))
        response.headers.update(getattr(error, "headers", None) or {})
        return response

    @app.get("/health")
    async def health():
        ready = picker.ready_endpoints()
        return Response(status_code=200) if ready else error_response(503, "no engine endpoint is ready")

    @app.api_route("/{_:path}", methods=ALL_METHODS)
    async def dispatch(request: Request):
        """Every client request, by the route table (routes.py): the exact path as sent, undecoded."""
        path = request.scope.get("raw_path", request.url.path.encode()).decode("latin-1")
        route = route_of(request.method, path)
        if route.kind == "inference":
            return await forwarder(path.partition("?")[0], request)
        if route.kind == "models":
            return {"object": "list", "data": model_cards(picker.ready_endpoints())}
        if route.kind == "model":
            model_id = unquote(path.partition("?")[0][len(MODELS_ROUTE) + 1:])
            card = next((c for c in model_cards(picker.ready_endpoints()) if c["id"] == model_id), None)
            return card if card is not None else error_response(404, f"The model `{model_id}` does not exist.")
        return error_response(route.status, route.message)

    app.state.client = forwarder.clients  # closed with the gateway
    return app
