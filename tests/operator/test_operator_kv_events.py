"""spec.routing.kvEvents: the engines publish KV-cache events for the gateway's precise prefix routing.

On: the engine's command line carries --kv-events-config that the engine's own parsers accept, the container names
both ports, and the NetworkPolicy opens exactly those ports to the gateway's pods (not the API peers). Off: every
object is as before."""
from __future__ import annotations

import json

import kubernetes_validate
import pytest
from parallel_helpers import serve_parser

from kubeinfer.engine.core.kv_event_publisher import KVEventsConfig
from kubeinfer.operator.builders import desired_objects
from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.spec import SpecError, parse_spec

K8S = kubernetes_validate.utils.latest_version()
OWNER = {"apiVersion": "serving.kubeinfer.io/v1alpha1", "kind": "InferenceModel",
         "metadata": {"name": "chat", "namespace": "ml", "uid": "6f1c2a4e-0000-4000-8000-000000000030"}}
BASE = {"model": {"uri": "pvc://models/tiny"}, "routing": {"priority": 1}}
ON = {**BASE, "routing": {"priority": 1, "kvEvents": True}}
TWO_NODES = {"model": {"uri": "pvc://models/big"}, "routing": {"kvEvents": True},
             "engine": {"resources": {"gpus": 4}, "parallelism": {"tensor": 4, "nodes": 2}}}
GATEWAY = {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "gateway"}}}


def objects(raw: dict, config: OperatorConfig | None = None) -> dict[str, dict]:
    spec = parse_spec("chat", raw)
    return {o["kind"]: o for o in desired_objects(OWNER, spec, config or OperatorConfig(), with_pool=False)}


def engine_container(raw: dict) -> dict:
    return objects(raw)["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def test_engine_publishes_on_the_named_ports_with_a_config_the_engine_accepts():
    for obj in objects(ON).values():
        kubernetes_validate.validate(obj, K8S, strict=True)
    container = engine_container(ON)
    args = serve_parser(allow_abbrev=False).parse_args(container["args"][1:])
    assert json.loads(args.kv_events_config) == {"enable_kv_cache_events": True, "publisher": "zmq",
                                                 "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    config = KVEventsConfig.parse(args.kv_events_config)
    assert config is not None and (config.endpoint, config.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "kv-events": 5557, "kv-replay": 5558}
    # the engine advertises its pod's IP for the `*` it binds (kv_event_publisher.advertised)
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]


def test_events_off_leaves_every_object_as_before_and_on_changes_only_the_pods_and_policy():
    off = objects({**BASE, "routing": {"priority": 1, "kvEvents": False}})
    assert off == objects(BASE)
    on = objects(ON)
    assert {kind for kind in on if on[kind] != off[kind]} == {"Deployment", "NetworkPolicy"}
    container = off["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert "--kv-events-config" not in container["args"]
    assert [p["name"] for p in container["ports"]] == ["http", "grpc"]
    assert all(e["name"] != "POD_IP" for e in container["env"])
    assert [p["port"] for p in off["NetworkPolicy"]["spec"]["ingress"][0]["ports"]] == [8000, 8001]


ENVOY = {"namespaceSelector": {"matchLabels": {"gateway": "envoy"}}}
KV_PORTS = [{"protocol": "TCP", "port": 5557}, {"protocol": "TCP", "port": 5558}]


@pytest.mark.parametrize("config", [OperatorConfig(), OperatorConfig(api_peers=(GATEWAY, ENVOY))])
def test_network_policy_opens_the_event_ports_to_the_gateway_alone(config):
    """Issue #44: the KV-event ports took every API peer (extraApiPeers included), so any of them could read
    every cached block's token ids. Now a rule of their own, from the gateway's pods only."""
    on, off = objects(ON, config)["NetworkPolicy"], objects(BASE, config)["NetworkPolicy"]
    kubernetes_validate.validate(on, K8S, strict=True)
    api, events = on["spec"]["ingress"]
    assert api == off["spec"]["ingress"][0]  # the API rule is as without kvEvents
    assert [p["port"] for p in api["ports"]] == [8000, 8001]
    assert events["ports"] == KV_PORTS
    assert events["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "kubeinfer",
                                                               "app.kubernetes.io/component": "gateway"}}}]
    assert ENVOY not in events["from"] and all("operator" not in str(peer) for peer in events["from"])
    assert len(off["spec"]["ingress"]) == 1


def test_the_event_ports_peers_come_from_their_own_flag():
    from kubeinfer.operator.cli import add_arguments, config_from

    parser = __import__("argparse").ArgumentParser()
    add_arguments(parser)
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "llm"}}, **GATEWAY}]
    config = config_from(parser.parse_args(["--network-policy-api-peers", json.dumps([GATEWAY, ENVOY]),
                                            "--network-policy-kv-events-peers", json.dumps(peers)]))
    (_, events) = objects(ON, config)["NetworkPolicy"]["spec"]["ingress"]
    assert events == {"from": peers, "ports": KV_PORTS}


def test_only_the_leader_of_a_multi_node_group_publishes():
    lws = objects(TWO_NODES)["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    leader = lws["leaderTemplate"]["spec"]["containers"][0]
    worker = lws["workerTemplate"]["spec"]["containers"][0]
    assert "--kv-events-config" in leader["args"] and "--kv-events-config" not in worker["args"]
    assert {"kv-events", "kv-replay"} <= {p["name"] for p in leader["ports"]}


@pytest.mark.parametrize("arg", ["--kv-events-config", "--kv-events-config={}", "--kv-events"])
def test_kv_events_config_in_engine_args_is_refused(arg):
    with pytest.raises(SpecError, match=r"spec\.engine\.args\[0\] must not set --kv-events-config.*kvEvents"):
        parse_spec("chat", {**BASE, "engine": {"args": [arg, "{}"]}})


def test_kv_events_must_be_a_boolean():
    with pytest.raises(SpecError, match=r"spec\.routing\.kvEvents must be true or false, got 'yes'"):
        parse_spec("chat", {**BASE, "routing": {"kvEvents": "yes"}})
