"""One proxied request: its attempts on engines; the response that wins is relayed by relay.py.

An attempt that fails before the first byte of a response (no connection, a reset, no answer within
the first-byte timeout) or that an engine refuses with a status meaning "not here" (429 queue full,
503 not ready, 404 for a model it does not hold) is moved to another endpoint, picked again without
the ones already tried. When none is left the client gets the engine's own refusal, or a 502/503/504
naming every cause. A client that goes away, before the response or during it, is counted as a
cancellation, never as an upstream error, and its upstream connection is closed (the engine aborts).
When no pod of the model is left, the request moves to the model's first fallback that has a pod
(fallback.py). The tenant ticket sees the response pass (its `usage`) and is settled when it ends.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import Response

from ..datastore.endpoints import Endpoint
from ..datastore.engine_auth import for_engine
from ..datastore.http_client import describe
from ..flowcontrol.deadline import TIMEOUT_HEADER, remaining_ms_header
from ..scheduling.picker import RoutingError, RoutingRequest
from .extproc import error_body
from .relay import CLIENT_CLOSED, HOP_BY_HOP, UpstreamStream, relay_response, relayed_headers
from .routing import Router
from .upstream import (
    RETRY_ELSEWHERE,
    ClientShards,
    FirstByteTimeout,
    UpstreamConfig,
    failure_status,
    retry_reason,
)

logger = logging.getLogger(__name__)


def _retry_after(error: RoutingError) -> str | None:
    return str(error.retry_after) if error.retry_after is not None else None


def error_response(status: int, message: str, retry_after: str | None = None) -> Response:
    if retry_after is None and status in (429, 503):
        retry_after = "1"
    headers = {"Retry-After": retry_after} if retry_after else None
    return Response(json.dumps(error_body(status, message)), status_code=status, headers=headers,
                    media_type="application/json")


@dataclass
class Refusal:
    """An engine's own non-success answer, kept (read whole) in case no other endpoint takes the request."""
    status: int
    headers: dict[str, str]
    body: bytes

    def response(self) -> Response:
        return Response(self.body, status_code=self.status, headers=self.headers)


def _model_missing(response: httpx.Response, body: bytes) -> bool:
    """A 404 about the model (not an unknown path, which every pod would answer the same)."""
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return False
    return error.get("param") == "model" or "model" in str(error.get("message", "")).lower()


def _model_of(raw: bytes) -> str:
    try:
        return str(json.loads(raw).get("model", ""))
    except (ValueError, AttributeError):
        return ""


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Forwarder:
    def __init__(self, router: Router, clients: ClientShards, config: UpstreamConfig) -> None:
        self.router, self.clients, self.config = router, clients, config

    async def __call__(self, path: str, request: Request) -> Response:
        raw = await request.body()
        try:
            routed = await self._route_or_hold(raw, request)
        except RoutingError as error:
            return error_response(error.status, error.message, _retry_after(error))
        if routed is None:  # the client left while its request was held
            return Response(status_code=CLIENT_CLOSED)
        routing_request, decision = routed
        ticket = routing_request.ticket
        try:
            response = await self._attempts(path, request, raw, routing_request, decision)
        except BaseException:
            if ticket is not None:  # the tenant's concurrency slot must not leak
                ticket.finish(500)
            raise
        if ticket is not None and not isinstance(response, UpstreamStream):
            ticket.finish(response.status_code)  # a relayed stream settles its ticket when it ends
        return response

    async def _attempts(self, path: str, request: Request, raw: bytes, routing_request: RoutingRequest,
                        decision) -> Response:
        body = self.router.body_for_engine(raw, routing_request)
        headers = for_engine(request.headers, self.config.engine_api_key, drop=HOP_BY_HOP)
        start, metrics, model = time.perf_counter(), self.router.metrics, routing_request.model
        endpoint, sent = decision.endpoint, decision.sent
        errors: list[str] = []
        failures: list[BaseException] = []
        refusal: Refusal | None = None
        for attempt in range(self.config.max_attempts):
            if attempt:
                try:
                    retry = self.router.reroute(routing_request, endpoint.address)
                except RoutingError:  # no other pod of this model: its fallback, if one can take it
                    retry = self.router.fall_back(routing_request, endpoint.address)
                    if retry is None:
                        break
                    body = self.router.body_for_engine(raw, routing_request)
                    model = routing_request.model
                endpoint, sent = retry.endpoint, retry.sent
            budget = remaining_ms_header(routing_request.deadline)
            if budget is not None:  # what the gateway did not spend, for the engine to honour
                headers[TIMEOUT_HEADER] = budget
            client, release = self.clients.acquire()
            upstream = client.build_request("POST", f"{endpoint.url}{path}", content=body, headers=headers,
                                            params=request.query_params)
            try:
                response = await self._send(client, upstream, request)
            except asyncio.CancelledError:  # the client went away while the engine had not answered
                release()
                endpoint.record_finish(sent)
                metrics.cancelled.labels(model).inc()
                return Response(status_code=CLIENT_CLOSED)
            except (httpx.HTTPError, FirstByteTimeout) as error:
                release()
                endpoint.record_finish(sent)
                if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
                    endpoint.record_failure()
                errors.append(f"{endpoint.address}: {describe(error)}")
                failures.append(error)
                refusal = None
                metrics.retries.labels(retry_reason(error)).inc()
                logger.warning("endpoint %s failed before answering: %s", endpoint.address, describe(error))
                continue
            if response.status_code in RETRY_ELSEWHERE and attempt + 1 < self.config.max_attempts:
                refusal, retry = await self._read_refusal(response, endpoint, sent, routing_request)
                release()
                if retry:
                    metrics.retries.labels(retry_reason(status=response.status_code)).inc()
                    continue
                return refusal.response()  # final (a 404 every pod would give): the engine's answer, read whole
            return relay_response(response, endpoint, sent, model, start, release, routing_request.ticket,
                                  self.config.idle_timeout, metrics)
        if refusal is not None:  # every endpoint refused: the last engine's own answer, Retry-After and all
            metrics.errors.labels(model, str(refusal.status)).inc()
            return refusal.response()
        status = failure_status(failures) if failures else 503
        metrics.errors.labels(model, str(status)).inc()
        causes = "; ".join(errors) or "no other endpoint serves the model"
        return error_response(status, f"no engine endpoint could take the request ({causes})")

    async def _route_or_hold(self, raw: bytes, request: Request):
        """The routing decision, after a hold if the model has no ready engine; None if the client leaves."""
        routing = asyncio.ensure_future(self.router.route_or_hold(raw, {k.lower(): v for k, v in request.headers.items()}))
        if routing.done() or not self.router.hold:
            return await routing
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({routing, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not routing.done():
            routing.cancel()  # leaves the hold queue
            self.router.metrics.cancelled.labels(self.router.model_label(_model_of(raw))).inc()
            return None
        return routing.result()

    async def _send(self, client: httpx.AsyncClient, upstream: httpx.Request, request: Request) -> httpx.Response:
        """The engine's response head, or an error; CancelledError when the client leaves first."""
        sending = asyncio.ensure_future(asyncio.wait_for(client.send(upstream, stream=True),
                                                         self.config.first_byte_timeout))
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not sending.done():
            sending.cancel()
            raise asyncio.CancelledError
        try:
            return sending.result()
        except TimeoutError:
            raise FirstByteTimeout(f"no response within {self.config.first_byte_timeout:g} s") from None

    async def _read_refusal(self, response: httpx.Response, endpoint: Endpoint, sent: float,
                            request: RoutingRequest) -> tuple[Refusal, bool]:
        """Reads a refusal whole; with whether another pod may take the request (not for a 404 that is
        not about the model: an unknown route, which every pod would answer the same)."""
        try:
            body = await response.aread()
        except httpx.HTTPError:
            body = b""
        finally:
            await response.aclose()
            endpoint.record_finish(sent)
        refusal = Refusal(response.status_code, relayed_headers(response.headers), body)
        if response.status_code == 404:
            if not _model_missing(response, body):
                return refusal, False
            endpoint.drop_model(request.model)  # placement said so, the pod disagrees: believe the pod
        return refusal, True
