"""Proxy mode: the gateway as the HTTP front door, for clusters without Envoy and for local runs.

It answers `/v1/models` with the union of its endpoints' models and forwards every other OpenAI request,
streamed responses included, to the endpoint the picker chose. A request is retried once on the next
endpoint when the first refuses the connection before any byte of the response, so a pod that just died
loses nothing. A client that goes away closes the upstream stream, which aborts the engine's request.
Every request's end is reported to its endpoint (`record_finish`), so the picker's load figures drop
the moment a response completes, not at the next scrape.
"""
from __future__ import annotations

import logging
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .extproc import error_body
from .picker import RoutingError
from .routing import Router

logger = logging.getLogger(__name__)
HOP_BY_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate"}
MAX_ATTEMPTS = 2  # the pick, then one retry on a fallback


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers={"Retry-After": "1"} if status == 429 else None)


class UpstreamStream(StreamingResponse):
    """Relays an upstream response; `on_close` runs however the relay ends (done, error or client gone),
    so the upstream stream is closed at once and the engine aborts the request."""

    def __init__(self, upstream: httpx.Response, headers: dict[str, str], on_close) -> None:
        super().__init__(upstream.aiter_raw(), status_code=upstream.status_code, headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


def build_proxy_app(router: Router, client: httpx.AsyncClient | None = None) -> FastAPI:
    app = FastAPI(title="kubeinfer gateway", description="OpenAI-compatible front door over kubeinfer engines")
    client = client or httpx.AsyncClient(timeout=httpx.Timeout(connect=2.0, read=None, write=60.0, pool=60.0))
    picker = router.picker

    @app.get("/health")
    async def health():
        ready = picker.ready_endpoints()
        return Response(status_code=200) if ready else error_response(503, "no engine endpoint is ready")

    @app.get("/v1/models")
    async def models():
        cards: dict[str, dict] = {}
        for endpoint in picker.ready_endpoints():
            parent = min(endpoint.base_models, default=None)
            for model in sorted(endpoint.models | endpoint.placed_adapters):
                is_base = model in endpoint.base_models
                cards.setdefault(model, {"id": model, "object": "model", "owned_by": "kubeinfer",
                                         "parent": None if is_base else parent})
        return {"object": "list", "data": sorted(cards.values(), key=lambda c: (c["parent"] is not None, c["id"]))}

    @app.api_route("/v1/{path:path}", methods=["POST"])
    async def forward(path: str, request: Request):
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        try:
            routing_request, decision = router.route(body, {k.lower(): v for k, v in request.headers.items()})
        except RoutingError as error:
            return error_response(error.status, error.message)
        body = router.body_for_engine(body, routing_request)
        headers.pop("content-length", None)  # httpx sets it for the body it sends
        start = time.perf_counter()
        for attempt, endpoint in enumerate([decision.endpoint, *decision.fallbacks][:MAX_ATTEMPTS]):
            sent = decision.sent if attempt == 0 else endpoint.record_dispatch()
            upstream = client.build_request("POST", f"{endpoint.url}/v1/{path}", content=body, headers=headers,
                                            params=request.query_params)
            try:
                response = await client.send(upstream, stream=True)
            except httpx.ConnectError as error:  # refused before any byte: safe to retry elsewhere
                endpoint.record_finish(sent)
                endpoint.record_failure()
                logger.warning("endpoint %s refused a request (%s); attempt %d", endpoint.address, error, attempt + 1)
                router.metrics.retries.inc()
                continue
            except httpx.HTTPError as error:  # it took the request, then failed: resending could run it twice
                endpoint.record_finish(sent)
                router.metrics.errors.labels(routing_request.model, "502").inc()
                return error_response(502, f"engine endpoint {endpoint.address} failed: {error}")

            async def finish(response=response, endpoint=endpoint, sent=sent) -> None:
                endpoint.record_finish(sent)  # the request no longer loads the engine: the picker knows at once
                await response.aclose()
                router.metrics.duration.labels(routing_request.model).observe(time.perf_counter() - start)

            out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}
            out_headers["x-gateway-destination-endpoint"] = endpoint.address
            return UpstreamStream(response, out_headers, finish)
        router.metrics.errors.labels(routing_request.model, "503").inc()
        return error_response(503, "no engine endpoint accepted the connection; retry later")

    return app
