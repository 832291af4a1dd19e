"""The gateway's flow-control layers: registered by name, composed in order by the flags (today's wiring) or a
FlowControlConfig file (--flow-control-config); a layer added in a test runs in the request path."""
from __future__ import annotations

import argparse
import asyncio

import pytest
from test_gateway_tenants import write_tenants

from kubeinfer.gateway import cli
from kubeinfer.gateway.app import Gateway, GatewayConfig
from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool, EngineState
from kubeinfer.gateway.flowcontrol.composition import build_flow, check_layers
from kubeinfer.gateway.flowcontrol.fair_queue import FairQueue
from kubeinfer.gateway.flowcontrol.framework import FlowLayer
from kubeinfer.gateway.flowcontrol.hold import HoldQueue
from kubeinfer.gateway.flowcontrol.registry import register_layer, registered, unregister
from kubeinfer.gateway.handlers.metrics import GatewayMetrics
from kubeinfer.gateway.handlers.routing import Router
from kubeinfer.gateway.scheduling.picker import Picker, PickerConfig, RoutingError

BODY = b'{"model": "base", "prompt": "hi"}'


def router_with(*pods: tuple[str, EngineState]) -> Router:
    pool = EndpointPool()
    endpoints = []
    for address, state in pods:
        endpoint = Endpoint(address)
        endpoint.record_scrape(state, frozenset({"base"}), frozenset({"base"}))
        endpoints.append(endpoint)
    pool.set_members(endpoints)
    picker = Picker(pool, PickerConfig())
    return Router(picker, GatewayMetrics(picker))


def types(gateway: Gateway) -> list[str]:
    return [layer.type_name for layer in gateway.router.flow.layers]


@pytest.mark.parametrize("flags,expected", [
    ({}, ["tokenize", "fallback", "hold"]),
    ({"usage_log": "USAGE"}, ["tenants", "tokenize", "fallback", "hold"]),
    ({"tenants_file": "TENANTS"}, ["tenants", "tokenize", "fallback", "hold", "fair-queue"]),
    ({"tenants_file": "TENANTS", "fair_queue": False}, ["tenants", "tokenize", "fallback", "hold"]),
    ({"fair_queue": True}, ["tokenize", "fallback", "hold", "fair-queue"]),
])
def test_the_default_composition_is_the_flags_wiring(tmp_path, flags, expected):
    """The layers the gateway wired by hand before the composition, in the order it ran them."""
    values = {"TENANTS": write_tenants(tmp_path), "USAGE": str(tmp_path / "usage.jsonl")}
    gateway = Gateway(GatewayConfig(endpoints=["127.0.0.1:1"], hold_max=7, hold_timeout=3.0,
                                    fair_queue_max_per_tenant=5, forward_priority=True,
                                    **{k: values.get(v, v) for k, v in flags.items()}))
    assert types(gateway) == expected
    assert (gateway.router.hold.max_held, gateway.router.hold.timeout) == (7, 3.0)
    if "fair-queue" in expected:
        assert (gateway.router.fair_queue.max_per_tenant, gateway.router.fair_queue.preempt) == (5, True)
    assert (gateway.router.tenants is not None) == ("tenants" in expected)


def test_a_configured_composition_runs_its_layers_in_order_with_flag_defaults(tmp_path):
    layers = check_layers({"layers": [{"type": "tenants"}, {"type": "hold", "parameters": {"maxHeld": 3}},
                                      {"type": "fair-queue", "parameters": {"timeout": 2}}]})
    gateway = Gateway(GatewayConfig(endpoints=["127.0.0.1:1"], tenants_file=write_tenants(tmp_path),
                                    hold_timeout=9.0, fair_queue=False, flow_control=layers))
    assert types(gateway) == ["tenants", "hold", "fair-queue"]  # listed: on, whatever --fair-queue says
    assert (gateway.router.hold.max_held, gateway.router.hold.timeout) == (3, 9.0)
    assert gateway.router.fair_queue.timeout == 2.0
    with pytest.raises(ValueError, match="tenants layer needs a tenants file or a usage log"):
        Gateway(GatewayConfig(endpoints=["127.0.0.1:1"], flow_control=check_layers({"layers": [{"type": "tenants"}]})))


@pytest.mark.parametrize("document,error", [
    ({"layers": [{"type": "no-such-layer"}]}, "unknown flow-control layer type 'no-such-layer'; registered: tenants"),
    ({"layers": [{"type": "hold"}, {"type": "hold"}]}, "layer `hold` is listed twice"),
    ({"layers": [{"type": "hold", "parameters": {"maxheld": 3}}]}, "takes no parameter maxheld; it takes: maxHeld"),
    ({"layers": "hold"}, "a mapping with a `layers` list"),
    ({"layers": [{"parameters": {}}]}, "a layer needs a `type`"),
])
def test_a_bad_composition_is_refused_with_its_reason(document, error):
    with pytest.raises(ValueError, match=error):
        check_layers(document)


def test_the_cli_reads_the_flow_control_config(tmp_path):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    path = tmp_path / "flow.yaml"
    path.write_text("kind: FlowControlConfig\nlayers:\n- type: fallback\n- {type: hold, parameters: {timeout: 5}}\n")
    config = cli.config_from_args(parser.parse_args(["--endpoints", "a:1", "--flow-control-config", str(path)]))
    assert config.flow_control == [{"type": "fallback", "parameters": {}},
                                   {"type": "hold", "parameters": {"timeout": 5}}]
    assert cli.config_from_args(parser.parse_args(["--endpoints", "a:1"])).flow_control is None
    path.write_text("layers:\n- type: nope\n")
    with pytest.raises(SystemExit, match="unknown flow-control layer type 'nope'; registered: .*fair-queue"):
        cli.config_from_args(parser.parse_args(["--endpoints", "a:1", "--flow-control-config", str(path)]))


async def test_without_the_hold_layer_a_model_with_no_ready_pod_is_refused_at_once():
    router = router_with(("10.0.0.1:8000", EngineState()))
    pod = next(iter(router.picker.pool))
    for _ in range(3):  # --max-failures: out of the ready set, still known to serve `base`
        pod.record_failure()
    router.hold = HoldQueue(router.has_ready_endpoint, timeout=0.3)
    with pytest.raises(RoutingError) as held:
        await router.route_or_hold(BODY, {})
    assert held.value.status == 503 and "within 0.3 s" in held.value.message  # it was held, then timed out
    router.flow = build_flow(GatewayConfig(flow_control=check_layers({"layers": [{"type": "fallback"}]})),
                             router.flow_handle)
    assert router.hold is None
    with pytest.raises(RoutingError) as refused:
        await asyncio.wait_for(router.route_or_hold(BODY, {}), 0.2)
    assert refused.value.status == 503 and "within" not in refused.value.message


def test_setting_a_layer_state_composes_it_in_its_default_place():
    router = router_with(("10.0.0.1:8000", EngineState()))
    assert [layer.type_name for layer in router.flow.layers] == ["tokenize", "fallback"]
    router.fair_queue = FairQueue(router.picker)
    router.hold = HoldQueue(router.has_ready_endpoint)
    assert [layer.type_name for layer in router.flow.layers] == ["tokenize", "fallback", "hold", "fair-queue"]
    router.fair_queue = None
    assert router.fair_queue is None and "fair-queue" not in router.flow


class RefuseBatch(FlowLayer):
    """Refuses requests that say they are batch work while `busy`; counts the picks it hears."""
    parameter_names = frozenset({"status"})

    def __init__(self, parameters=None, handle=None, state=None) -> None:
        super().__init__(parameters, handle)
        self.picks: list[tuple[str, bool]] = []

    async def admit(self, admission):
        if admission.headers.get("x-batch") == "1":
            raise RoutingError(int(self.parameters.get("status", 429)), "batch work waits for the night")
        return None

    def dispatched(self, request, decision, retry):
        self.picks.append((decision.endpoint.address, retry))


@pytest.fixture
def refuse_batch():
    register_layer("refuse-batch", RefuseBatch)
    yield
    unregister("refuse-batch")


async def test_a_layer_added_in_one_module_runs_in_the_request_path(refuse_batch):
    assert "refuse-batch" in registered()
    router = router_with(("10.0.0.1:8000", EngineState()), ("10.0.0.2:8000", EngineState()))
    layers = check_layers({"layers": [{"type": "refuse-batch", "parameters": {"status": 503}}, {"type": "hold"}]})
    router.flow = build_flow(GatewayConfig(flow_control=layers), router.flow_handle)
    with pytest.raises(RoutingError) as refused:
        await router.route_or_hold(BODY, {"x-batch": "1"})
    assert refused.value.status == 503 and refused.value.message == "batch work waits for the night"
    request, decision = await router.route_or_hold(BODY, {})
    retry = router.reroute(request, decision.endpoint.address)
    assert router.flow.get("refuse-batch").picks == [(decision.endpoint.address, False), (retry.endpoint.address, True)]
