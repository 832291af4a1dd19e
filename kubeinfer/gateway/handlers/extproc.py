"""Envoy external processing (ext_proc) server: the Gateway API Inference Extension's endpoint picker.

Envoy streams each HTTP request to us (`envoy.service.ext_proc.v3.ExternalProcessor/Process`). We parse
the OpenAI JSON body, pick an endpoint and answer with the header
`x-gateway-destination-endpoint: ip:port[,fallback,...]` plus the same value in dynamic metadata
(namespace `envoy.lb`), which Envoy's original-destination cluster dials. When no endpoint can take
the request we answer with an ImmediateResponse (503, 404, 429 or 400) carrying OpenAI's error shape.
A subset hint from the data plane (`envoy.lb.subset_hint` filter metadata) limits the pick to its endpoints.

Two body modes, told apart by the `protocol_config` Envoy (1.34+) sends with the first message:
  * BUFFERED / STREAMED (half duplex): the headers are answered at once, the body chunks pass, and the
    answer to the last one carries the destination (with BUFFERED, Envoy holds the headers until then);
  * FULL_DUPLEX_STREAMED, what the Inference Extension's protocol asks for: Envoy sends body chunks
    without waiting, and forwards only what we send back. The headers' answer waits for the whole body,
    then carries the destination and Content-Length; the body goes back whole after it, with the
    engine's `priority` written in with --forward-priority (half duplex cannot change the body).
    Response body chunks are echoed back as they come.
When the filter also sends the response phases, the end of the response body, or the stream closing
after the response began, tells the picker the request is over (on the pod that served it, when the
data plane names one after a retry); without them it stays counted until the next scrape of its pod.
Tenants (tenant_gate.py): a request's tenant slot is held until its response ends, or until Envoy closes
the stream; its usage is read from the response body when Envoy sends it (response_body_mode STREAMED
or FULL_DUPLEX_STREAMED), else its token charge stays the admission estimate and its status is unknown.
A fallback model is used only in full duplex, the one mode where the body (its `model`) can be rewritten.
Only the routes of routes.py pass: any other `:method` `:path` is answered at the request headers with
an ImmediateResponse (404, or 403 for adapter management) and never reaches an engine.
Limits (issue #34): the request body is buffered up to `max_body_bytes` (413 beyond, at the chunk that
passes it); the engines' key (`--engine-api-key`) is set on the routed request as `Authorization`, in place
of the client's; a stream in full duplex both ways gets `include_usage` asked for and its usage event
removed on the way back, as in the proxy.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kubeinfer.common.grpc_health import HealthCheckedServer
from kubeinfer.common.http_guard import DEFAULT_MAX_BODY_BYTES, bounded_message

from ..datastore.engine_auth import engine_authorization
from ..flowcontrol.deadline import TIMEOUT_HEADER, remaining_ms_header
from ..scheduling.picker import Decision, RoutingError
from .routes import route_of
from .routing import Router
from .usage_strip import UsageEventStripper

logger = logging.getLogger(__name__)
DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE, SUBSET_KEY = "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"  # in envoy.lb, on the response: where a retry landed
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
HEALTH_SERVICES = ("envoy.service.ext_proc.v3.ExternalProcessor", "liveness", "readiness")
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
               413: "RequestTooLargeError",
               429: "RateLimitError", 502: "BadGatewayError", 503: "ServiceUnavailableError"}
_PASS_THROUGH = {
    "response_headers": lambda: ep.ProcessingResponse(response_headers=ep.HeadersResponse()),
    "response_body": lambda: ep.ProcessingResponse(response_body=ep.BodyResponse()),
    "request_trailers": lambda: ep.ProcessingResponse(request_trailers=ep.TrailersResponse()),
    "response_trailers": lambda: ep.ProcessingResponse(response_trailers=ep.TrailersResponse()),
}


def header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    return {h.key.lower(): h.value or h.raw_value.decode("utf-8", "replace") for h in headers.headers}


def subset_hint(message: ep.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the data plane allows for this request, when it says (None: any of the pool)."""
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    return frozenset(v.string_value for v in namespace.fields[SUBSET_KEY].list_value.values)


def response_status(headers: base_pb2.HeaderMap) -> int | None:
    status = header_map(headers).get(":status", "")
    return int(status) if status.isdigit() else None


def served_endpoint(message: ep.ProcessingRequest) -> str | None:
    namespace = message.metadata_context.filter_metadata.get(METADATA_NAMESPACE)
    return namespace.fields[SERVED_KEY].string_value if namespace and SERVED_KEY in namespace.fields else None


def routed(phase: str, destination: str, content_length: int | None = None,
           extra: tuple[tuple[str, str], ...] = ()) -> ep.ProcessingResponse:
    """Continue, with the destination header set (and `extra` headers) and the same value in dynamic
    metadata."""
    values = [(DESTINATION_HEADER, destination), *extra]
    if content_length is not None:  # full duplex: Envoy dropped the header, the body we return is this long
        values.append(("content-length", str(content_length)))
    mutation = ep.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD) for key, value in values])
    common = ep.CommonResponse(header_mutation=mutation, clear_route_cache=True)
    metadata = struct_pb2.Struct()
    metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: destination}})
    if phase == "request_headers":
        return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata)
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)


def streamed_body(phase: str, body: bytes, end_of_stream: bool) -> ep.ProcessingResponse:
    """Full duplex: body bytes sent back to Envoy, which forwards only what it gets back."""
    response = ep.BodyResponse(response=ep.CommonResponse(body_mutation=ep.BodyMutation(
        streamed_response=ep.StreamedBodyResponse(body=body, end_of_stream=end_of_stream))))
    return ep.ProcessingResponse(**{phase: response})


def error_body(status: int, message: str) -> dict:
    """OpenAI's error shape, as the engines answer: clients handle the gateway's refusals the same way. The message
    is bounded: it may quote the client (an unknown model's name)."""
    return {"error": {"message": bounded_message(message), "type": ERROR_TYPES.get(status, "APIError"), "param": None, "code": status}}


def refused(error: RoutingError) -> ep.ProcessingResponse:
    body = error_body(error.status, error.message)
    headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type",
                                                                       raw_value=b"application/json"))]
    if error.status in (429, 503) or error.retry_after is not None:
        retry_after = str(error.retry_after if error.retry_after is not None else 1).encode()
        headers.append(base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="retry-after", raw_value=retry_after)))
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.status), headers=ep.HeaderMutation(set_headers=headers),
        body=json.dumps(body).encode(), details=f"kubeinfer_gateway_{error.status}"))


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    def __init__(self, router: Router, engine_api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.router, self.max_body_bytes = router, max_body_bytes
        self.engine_headers = tuple(engine_authorization(engine_api_key).items())

    async def decide(self, phase: str, headers: dict[str, str], body: bytes, subset: frozenset[str] | None,
                     full_duplex: bool = False, strips_usage: bool = False
                     ) -> tuple[list[ep.ProcessingResponse], Decision | None, object]:
        """The replies, the decision, and the tenant ticket to settle when the response ends. Only full
        duplex can rewrite the body, so only it may send a request to a fallback model."""
        try:
            request, decision = await self.router.route_or_hold(body, headers, subset, rewrite_body=full_duplex)
        except RoutingError as error:
            return [refused(error)], None, None
        budget = remaining_ms_header(request.deadline)
        extra = ((TIMEOUT_HEADER, budget),) if budget is not None else ()  # what is left, for the engine
        extra += self.engine_headers
        # Only a body sent back whole (full duplex) can ask for usage, and only a response relayed by us can lose it.
        request.add_usage = full_duplex and strips_usage and request.add_usage and request.ticket is not None
        if not full_duplex:
            return [routed(phase, decision.destination, extra=extra)], decision, request.ticket
        # The headers' answer waited for the body; the body itself goes back whole, after it.
        body = self.router.body_for_engine(body, request, add_usage=request.add_usage)
        return [routed("request_headers", decision.destination, content_length=len(body), extra=extra),
                streamed_body("request_body", body, end_of_stream=True)], decision, request.ticket

    async def Process(self, request_iterator, context):
        headers: dict[str, str] = {}
        body = bytearray()
        subset: frozenset[str] | None = None
        decision: Decision | None = None
        ticket = None  # the tenant admission: settled when the response ends, or when the stream closes
        response_began = request_full_duplex = response_full_duplex = False
        stripper = None  # removes the usage event the gateway asked for (full duplex both ways)
        try:
            async for message in request_iterator:
                if message.HasField("protocol_config"):  # sent with the first message only
                    request_full_duplex = message.protocol_config.request_body_mode == FULL_DUPLEX
                    response_full_duplex = message.protocol_config.response_body_mode == FULL_DUPLEX
                phase = message.WhichOneof("request")
                if phase == "request_headers":
                    headers, subset = header_map(message.request_headers.headers), subset_hint(message)
                    route = route_of(headers.get(":method", ""), headers.get(":path", ""))
                    if route.kind == "refused":  # not an inference route: answered here, never sent on
                        yield refused(RoutingError(route.status, route.message))
                        return
                    if message.request_headers.end_of_stream:  # no body follows (GET): route on headers alone
                        replies, decision, ticket = await self.decide(phase, headers, b"", subset)
                        for reply in replies:
                            yield reply
                    elif not request_full_duplex:  # full duplex: the answer waits for the body
                        yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
                elif phase == "request_body":
                    if len(body) + len(message.request_body.body) > self.max_body_bytes:
                        yield refused(RoutingError(413, f"request body too large: over this gateway's limit of "
                                                        f"{self.max_body_bytes} bytes"))
                        return
                    body += message.request_body.body
                    if message.request_body.end_of_stream:
                        replies, decision, ticket = await self.decide(phase, headers, bytes(body), subset,
                                                                      request_full_duplex, response_full_duplex)
                        if ticket is not None and ticket.request.add_usage:
                            stripper = UsageEventStripper()
                        for reply in replies:
                            yield reply
                    elif not request_full_duplex:  # streamed: chunks pass; the decision comes with the last one
                        yield ep.ProcessingResponse(request_body=ep.BodyResponse())
                elif phase in _PASS_THROUGH:
                    response_began = response_began or phase.startswith("response")
                    if phase == "response_headers" and decision is not None:
                        decision = self._follow_retry(decision, served_endpoint(message))
                    if phase == "response_headers" and ticket is not None:
                        ticket.response_began(response_status(message.response_headers.headers))
                    if phase == "response_body" and ticket is not None:
                        ticket.feed(message.response_body.body)
                    if phase == "response_body" and response_full_duplex:
                        chunk = message.response_body
                        data = chunk.body if stripper is None else stripper.feed(chunk.body) + (
                            stripper.flush() if chunk.end_of_stream else b"")
                        yield streamed_body(phase, data, chunk.end_of_stream)
                    else:
                        yield _PASS_THROUGH[phase]()
                    ended = ((phase == "response_body" and message.response_body.end_of_stream)
                             or phase == "response_trailers")
                    if ended and decision is not None:
                        decision.endpoint.record_finish(decision.sent)
                        decision = None
                    if ended and ticket is not None:
                        ticket.finish()
        finally:  # the stream closed: after a response began, the request is over (done or abandoned)
            if decision is not None and response_began:
                decision.endpoint.record_finish(decision.sent)
            if ticket is not None:  # without response phases we never learn more: the estimate stands
                ticket.finish()

    def _follow_retry(self, decision: Decision, served: str | None) -> Decision:
        """Envoy retried on a fallback: the load we counted on the pick moves to the pod that served."""
        endpoint = self.router.picker.pool.endpoints.get(served) if served else None
        if endpoint is None or endpoint is decision.endpoint:
            return decision
        decision.endpoint.record_finish(decision.sent)
        return replace(decision, endpoint=endpoint, sent=endpoint.record_dispatch())


async def start_extproc_server(router: Router, host: str, port: int, **options) -> HealthCheckedServer:
    """ext_proc and gRPC health on host:port (port 0 picks a free one: see .port); `options`: ExternalProcessor's."""
    return await HealthCheckedServer.start(
        lambda server: ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(router, **options), server),
        HEALTH_SERVICES, host, port)
