"""Fallback models: a request for a model with no ready pod, with every pod saturated, or whose pods all
fail before answering goes to the first fallback that can serve it, with the body's `model` rewritten
(the response names what served); a counter says how often and why. Proxy and ext_proc modes."""
from __future__ import annotations

import json

import pytest
from prometheus_client import generate_latest
from test_gateway_tenants import Engine, _run, drop_connection, metrics_text, post, start_gateway

from kubeinfer.gateway.cli import _fallback
from kubeinfer.gateway.flowcontrol.fallback import Fallbacks, fallbacks_of


def fallback_count(text: str, model: str, fallback: str, reason: str) -> float:
    line = f'kubeinfer_gateway_fallbacks_total{{fallback="{fallback}",model_name="{model}",reason="{reason}"}} '
    return next((float(x[len(line):]) for x in text.splitlines() if x.startswith(line)), 0.0)


async def test_a_model_with_no_ready_pod_is_served_by_its_fallback():
    async with Engine(models=["small"]) as small:
        gateway = await start_gateway([small], fallbacks=[("big", "small")])
        try:
            response = await post(gateway, model="big")
            text = await metrics_text(gateway)
        finally:
            await gateway.stop()
    assert response.status_code == 200 and response.json()["model"] == "small"
    assert small.bodies[0]["model"] == "small" and small.bodies[0]["prompt"] == "hello there"
    assert fallback_count(text, "big", "small", "no_ready_endpoint") == 1


async def test_a_model_whose_pods_are_all_saturated_is_served_by_its_fallback():
    async with Engine(models=["big"], waiting=10) as big, Engine(models=["small"]) as small:
        gateway = await start_gateway([big, small], fallbacks=[("big", "small")])
        try:
            response = await post(gateway, model="big")
            text = await metrics_text(gateway)
        finally:
            await gateway.stop()
    assert response.json()["model"] == "small" and not big.bodies
    assert fallback_count(text, "big", "small", "saturated") == 1


async def test_without_a_fallback_a_saturated_model_still_serves_itself():
    async with Engine(models=["big"], waiting=10) as big, Engine(models=["small"]) as small:
        gateway = await start_gateway([big, small])
        try:
            response = await post(gateway, model="big")
        finally:
            await gateway.stop()
    assert response.json()["model"] == "big" and not small.bodies


async def test_a_failure_before_the_first_byte_on_every_pod_moves_to_the_fallback():
    async with Engine(models=["big"], on_post=drop_connection) as big, Engine(models=["small"]) as small:
        gateway = await start_gateway([big, small], fallbacks=[("big", "gone"), ("big", "small")])
        try:
            response = await post(gateway, model="big")
            text = await metrics_text(gateway)
        finally:
            await gateway.stop()
    assert response.status_code == 200 and response.json()["model"] == "small"
    assert [b["model"] for b in big.bodies] == ["big"] and [b["model"] for b in small.bodies] == ["small"]
    assert fallback_count(text, "big", "small", "failed") == 1


async def test_when_no_fallback_can_serve_the_client_gets_the_models_own_failure():
    async with Engine(models=["big"], on_post=drop_connection) as big:
        gateway = await start_gateway([big], fallbacks=[("big", "small")])
        try:
            response = await post(gateway, model="big")
        finally:
            await gateway.stop()
    assert response.status_code == 502 and "no engine endpoint could take the request" in response.json()["error"][
        "message"]


def _router(fallbacks):
    from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool, EngineState
    from kubeinfer.gateway.handlers.extproc import ExternalProcessor
    from kubeinfer.gateway.handlers.metrics import GatewayMetrics
    from kubeinfer.gateway.scheduling.picker import Picker, PickerConfig
    from kubeinfer.gateway.handlers.routing import Router

    pod = Endpoint("10.0.0.2:8000")
    pod.record_scrape(EngineState(), frozenset({"small"}), frozenset({"small"}))
    pool = EndpointPool()
    pool.set_members([pod])
    picker = Picker(pool, PickerConfig())
    router = Router(picker, GatewayMetrics(picker))
    router.fallbacks = Fallbacks(fallbacks)
    return ExternalProcessor(router), router


def _messages(body: dict):
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    duplex = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    first = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
                 base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")])))
    first.protocol_config.request_body_mode = duplex
    return [first, ep.ProcessingRequest(request_body=ep.HttpBody(body=json.dumps(body).encode(), end_of_stream=True))]


async def test_ext_proc_full_duplex_sends_the_rewritten_body_to_the_fallback():
    processor, router = _router([("big", "small")])
    replies = await _run(processor, _messages({"model": "big", "prompt": "x"}))
    headers = {h.header.key: h.header.raw_value for h in replies[0].request_headers.response.header_mutation.set_headers}
    assert headers["x-gateway-destination-endpoint"] == b"10.0.0.2:8000"
    body = json.loads(replies[1].request_body.response.body_mutation.streamed_response.body)
    assert body == {"model": "small", "prompt": "x"}
    assert fallback_count(generate_latest(router.metrics.registry).decode(), "big", "small", "no_ready_endpoint") == 1


async def test_ext_proc_half_duplex_cannot_rewrite_the_body_so_it_does_not_fall_back():
    processor, _ = _router([("big", "small")])
    messages = _messages({"model": "big", "prompt": "x"})
    messages[0].ClearField("protocol_config")
    replies = await _run(processor, messages)
    assert replies[-1].immediate_response.status.code == 404


def test_fallbacks_come_from_inference_models_and_the_flag_wins():
    listing = [{"metadata": {"name": "big", "namespace": "ns"},
                "spec": {"model": {"servedName": "llama-70b"}, "routing": {"fallback": ["llama-8b", "tiny"]}}},
               {"metadata": {"name": "plain", "namespace": "ns"}, "spec": {}}]
    assert fallbacks_of(listing) == {"llama-70b": ["llama-8b", "tiny"]}
    fallbacks = Fallbacks([("llama-70b", "static")])
    fallbacks.discovered.update(fallbacks_of(listing))
    assert fallbacks.of("llama-70b") == ["static"] and fallbacks.of("other") == []
    assert _fallback("a=b") == ("a", "b")
    with pytest.raises(Exception, match="MODEL=OTHER"):
        _fallback("a")
