"""The NetworkPolicy of one model: who may reach its engine pods, and on which ports.

Engines serve their API (HTTP 8000, gRPC 8001) to the gateway, which enforces tenants and limits,
and to the operator, which reads each pod's /v1/models; Prometheus scrapes /metrics on the HTTP port
(a NetworkPolicy cannot tell paths apart: the engine's API key guards /v1 there). Every other pod in
the cluster is refused, standby pods included. The kubelet's probes come from the node, which
NetworkPolicy always admits. It only takes effect with a CNI that enforces NetworkPolicy. A model over
several nodes also has one policy per group (group_network_policy_spec): a group's pods admit the pods of
the same group on every port (rendezvous, step channel, then NCCL or gloo on ports they choose at start),
and no other group's, standby groups included. With spec.routing.kvEvents the engine's KV-event PUB and
replay ports admit the gateway's pods alone (--network-policy-kv-events-peers), not the API peers: the events
carry every cached block's token ids, and only the gateway subscribes (precise prefix routing); where the
engine has an API key, CURVE refuses any other subscriber as well (docs/security.md).
"""
from __future__ import annotations

from typing import Any

from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.leader_worker import GROUP_INDEX_LABEL, SET_NAME_LABEL, lws_name
from kubeinfer.operator.names import GRPC_PORT, HTTP_PORT, KV_EVENTS_PORT, KV_REPLAY_PORT, selector_labels

PART_OF = {"app.kubernetes.io/part-of": "kubeinfer"}


def default_api_peers() -> list[dict[str, Any]]:
    """Without --network-policy-api-peers: the gateway's and the operator's pods in the model's namespace."""
    return [{"podSelector": {"matchLabels": {**PART_OF, "app.kubernetes.io/component": component}}}
            for component in ("gateway", "operator")]


def default_kv_events_peers() -> list[dict[str, Any]]:
    """Without --network-policy-kv-events-peers: the gateway's pods in the model's namespace."""
    return [{"podSelector": {"matchLabels": {**PART_OF, "app.kubernetes.io/component": "gateway"}}}]


def network_policy_spec(model: str, config: OperatorConfig, kv_events: bool = False) -> dict[str, Any]:
    api_ports = [{"protocol": "TCP", "port": HTTP_PORT}, {"protocol": "TCP", "port": GRPC_PORT}]
    ingress = [{"from": [dict(p) for p in config.api_peers] or default_api_peers(), "ports": api_ports}]
    if kv_events:
        ingress.append({"from": [dict(p) for p in config.kv_events_peers] or default_kv_events_peers(),
                        "ports": [{"protocol": "TCP", "port": KV_EVENTS_PORT},
                                  {"protocol": "TCP", "port": KV_REPLAY_PORT}]})
    if config.metrics_peers:
        ingress.append({"from": [dict(p) for p in config.metrics_peers],
                        "ports": [{"protocol": "TCP", "port": HTTP_PORT}]})
    # Every pod of the model, standby included; Ingress only: engines' own egress (fetchers, NCCL) is left alone.
    # Over several nodes the ranks' own ports are opened per group (group_network_policy_spec), never model-wide.
    return {"podSelector": {"matchLabels": selector_labels(model)}, "policyTypes": ["Ingress"], "ingress": ingress}


def group_pod_labels(model: str, group: int) -> dict[str, str]:
    """The pods of one multi-node group: the LeaderWorkerSet controller sets the set's name and the group's index."""
    return {**selector_labels(model), SET_NAME_LABEL: lws_name(model), GROUP_INDEX_LABEL: str(group)}


def group_network_policy_spec(model: str, group: int) -> dict[str, Any]:
    """Group `group`'s pods admit each other on every port, and no one else (NetworkPolicies add up: the API
    ports stay as the model's policy says)."""
    pods = {"podSelector": {"matchLabels": group_pod_labels(model, group)}}
    return {**pods, "policyTypes": ["Ingress"], "ingress": [{"from": [pods]}]}
