"""Envoy external processing (ext_proc) server: the Gateway API Inference Extension's endpoint picker.

Envoy streams each HTTP request to us (`envoy.service.ext_proc.v3.ExternalProcessor/Process`). Configure
the filter with `request_body_mode: BUFFERED` so that the request headers wait for our answer on the
body: we parse the OpenAI JSON, pick an endpoint and reply with the header
`x-gateway-destination-endpoint: ip:port[,fallback,...]` plus the same value in dynamic metadata
(namespace `envoy.lb`), which Envoy's original-destination cluster dials. When no endpoint can take
the request we answer with an ImmediateResponse (503, 404, 429 or 400) carrying OpenAI's error shape.
Every other phase is passed through unchanged. When the filter also sends the response phases
(`response_header_mode: SEND`, `response_body_mode: STREAMED`, as the Inference Extension's EPP asks
for), the end of the response body, or the stream closing after the response began, tells the picker
the request is over; without them it stays counted until the next scrape of its pod.
"""
from __future__ import annotations

import json
import logging

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from ..grpc_health import HealthCheckedServer
from .picker import Decision, RoutingError
from .routing import Router

logger = logging.getLogger(__name__)
DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError", 502: "BadGatewayError",
               503: "ServiceUnavailableError"}
_PASS_THROUGH = {
    "response_headers": lambda: ep.ProcessingResponse(response_headers=ep.HeadersResponse()),
    "response_body": lambda: ep.ProcessingResponse(response_body=ep.BodyResponse()),
    "request_trailers": lambda: ep.ProcessingResponse(request_trailers=ep.TrailersResponse()),
    "response_trailers": lambda: ep.ProcessingResponse(response_trailers=ep.TrailersResponse()),
}


def header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    return {h.key.lower(): h.value or h.raw_value.decode("utf-8", "replace") for h in headers.headers}


def routed(phase: str, destination: str) -> ep.ProcessingResponse:
    """Continue, with the destination header set and the same value in dynamic metadata."""
    mutation = ep.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=destination.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)])
    common = ep.CommonResponse(header_mutation=mutation, clear_route_cache=True)
    metadata = struct_pb2.Struct()
    metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: destination}})
    if phase == "request_headers":
        return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata)
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)


def error_body(status: int, message: str) -> dict:
    """OpenAI's error shape, as the engines answer: clients handle the gateway's refusals the same way."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"), "param": None, "code": status}}


def refused(error: RoutingError) -> ep.ProcessingResponse:
    body = error_body(error.status, error.message)
    headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type",
                                                                       raw_value=b"application/json"))]
    if error.status == 429:
        headers.append(base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="retry-after", raw_value=b"1")))
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.status), headers=ep.HeaderMutation(set_headers=headers),
        body=json.dumps(body).encode(), details=f"kubeinfer_gateway_{error.status}"))


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    def decide(self, phase: str, headers: dict[str, str], body: bytes) -> tuple[ep.ProcessingResponse, Decision | None]:
        try:
            _, decision = self.router.route(body, headers)
        except RoutingError as error:
            return refused(error), None
        return routed(phase, decision.destination), decision

    async def Process(self, request_iterator, context):
        headers: dict[str, str] = {}
        body = bytearray()
        decision: Decision | None = None
        response_began = False
        try:
            async for message in request_iterator:
                phase = message.WhichOneof("request")
                if phase == "request_headers":
                    headers = header_map(message.request_headers.headers)
                    if message.request_headers.end_of_stream:  # no body follows (GET): route on headers alone
                        reply, decision = self.decide(phase, headers, b"")
                        yield reply
                    else:
                        yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
                elif phase == "request_body":
                    body += message.request_body.body
                    if message.request_body.end_of_stream:
                        reply, decision = self.decide(phase, headers, bytes(body))
                        yield reply
                    else:  # streamed body mode: chunks pass; the decision comes with the last one
                        yield ep.ProcessingResponse(request_body=ep.BodyResponse())
                elif phase in _PASS_THROUGH:
                    response_began = response_began or phase.startswith("response")
                    yield _PASS_THROUGH[phase]()
                    ended = ((phase == "response_body" and message.response_body.end_of_stream)
                             or phase == "response_trailers")
                    if ended and decision is not None:
                        decision.endpoint.record_finish(decision.sent)
                        decision = None
        finally:  # the stream closed: after a response began, the request is over (done or abandoned)
            if decision is not None and response_began:
                decision.endpoint.record_finish(decision.sent)


async def start_extproc_server(router: Router, host: str, port: int) -> HealthCheckedServer:
    """ext_proc and gRPC health on host:port (port 0 picks a free one: see .port)."""
    return await HealthCheckedServer.start(
        lambda server: ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(router), server),
        "envoy.service.ext_proc.v3.ExternalProcessor", host, port)
