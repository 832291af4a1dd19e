"""The objects an InferenceModel owns, as plain dicts: Deployment (or, over several nodes, LeaderWorkerSet),
Service, PodDisruptionBudget, InferencePool, NetworkPolicy; over several nodes also the group secret and a
NetworkPolicy per group."""
from __future__ import annotations

from typing import Any

from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.group_secret import tp_secret
from kubeinfer.operator.leader_worker import leader_worker_set, multi_node
from kubeinfer.operator.names import (API_VERSION, GRPC_PORT, HTTP_PORT, KIND, MANAGED_BY_LABEL, MANAGER, MODEL_LABEL,
                                      POOL_GROUP, POOL_VERSION, active_labels, selector_labels)
from kubeinfer.operator.network_policy import group_network_policy_spec, network_policy_spec
from kubeinfer.operator.pod_template import pod_template
from kubeinfer.operator.spec import InferenceModelSpec
from kubeinfer.operator.template_hash import stamp_templates


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    """Makes the garbage collector delete what we built when the InferenceModel goes; no finalizer needed."""
    meta = owner["metadata"]
    if not meta.get("uid"):
        raise ValueError(f"InferenceModel {meta.get('name')!r} has no metadata.uid; owner references need one")
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _metadata(owner: dict[str, Any], spec: InferenceModelSpec) -> dict[str, Any]:
    return {"name": spec.name, "namespace": owner["metadata"]["namespace"],
            "labels": {**selector_labels(spec.name), MANAGED_BY_LABEL: MANAGER, MODEL_LABEL: spec.name},
            "ownerReferences": [owner_reference(owner)]}


def deployment(owner: dict[str, Any], spec: InferenceModelSpec, config: OperatorConfig) -> dict[str, Any]:
    """One Deployment of replicas + standby pods; roles are pod labels the operator sets, not template labels."""
    # A ready standby absorbs one pod missing during a rollout; without one, only surge.
    max_unavailable = 1 if spec.standby > 0 else 0
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(owner, spec),
        "spec": {
            "replicas": spec.pods,
            "selector": {"matchLabels": selector_labels(spec.name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": max_unavailable}},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": spec.engine.startup_timeout_seconds + 600,
            "template": pod_template(spec, config),
        },
    }


def service(owner: dict[str, Any], spec: InferenceModelSpec) -> dict[str, Any]:
    """ClusterIP over active pods only: standby pods never receive traffic."""
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(owner, spec),
        "spec": {"type": "ClusterIP", "selector": active_labels(spec.name),
                 "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                           {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                            "appProtocol": "kubernetes.io/h2c"}]},
    }


def pod_disruption_budget(owner: dict[str, Any], spec: InferenceModelSpec) -> dict[str, Any]:
    """Voluntary evictions never take serving capacity below spec.replicas while standby pods can cover it.

    Without standby, `minAvailable: replicas` would block every node drain forever, so one pod at a
    time may go instead. Crash-looping pods never block a drain (AlwaysAllow). Over several nodes pods are
    not replicas (a group restarts as a whole when one of its pods goes), so one pod, hence one group, at a time.
    """
    budget: dict[str, Any] = {"minAvailable": spec.replicas} if spec.standby > 0 else {"maxUnavailable": 1}
    if multi_node(spec):  # one evicted pod takes its whole group down: one group at a time
        budget = {"maxUnavailable": 1}
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _metadata(owner, spec),
        "spec": {**budget, "selector": {"matchLabels": selector_labels(spec.name)},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    }


def inference_pool(owner: dict[str, Any], spec: InferenceModelSpec, config: OperatorConfig) -> dict[str, Any]:
    """Gateway API Inference Extension v1 pool of the active pods, routed by our endpoint picker."""
    return {
        "apiVersion": f"{POOL_GROUP}/{POOL_VERSION}", "kind": "InferencePool", "metadata": _metadata(owner, spec),
        "spec": {"selector": {"matchLabels": active_labels(spec.name)},
                 "targetPorts": [{"number": HTTP_PORT}],
                 "endpointPickerRef": {"group": "", "kind": "Service", "name": config.endpoint_picker_service,
                                       "port": {"number": config.endpoint_picker_port},
                                       "failureMode": "FailClose"}},
    }


def network_policy(owner: dict[str, Any], spec: InferenceModelSpec, config: OperatorConfig) -> dict[str, Any]:
    """Ingress to the engine pods only from the gateway, the operator and the metrics scrapers."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _metadata(owner, spec),
            "spec": network_policy_spec(spec.name, config, spec.kv_events)}


def group_secret(owner: dict[str, Any], spec: InferenceModelSpec) -> dict[str, Any]:
    """A new random group secret for a multi-node model (created once, never applied over: group_secret.py)."""
    return tp_secret(_metadata(owner, spec))


GROUP_POLICY_INFIX = ".group-"  # a dot: no model's own object (a DNS label) can take the name


def group_network_policies(owner: dict[str, Any], spec: InferenceModelSpec) -> list[dict[str, Any]]:
    """Over several nodes, one NetworkPolicy per group: the replicas and standby groups, and the one a rolling
    update adds (maxSurge 1). Labelled without the managed-by label: the drift watch follows one policy per
    model; these are applied on every new generation (a changed replica count is one)."""
    if not multi_node(spec):
        return []
    metadata = _metadata(owner, spec)
    labels = {k: v for k, v in metadata["labels"].items() if k != MANAGED_BY_LABEL}
    return [{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
             "metadata": {**metadata, "name": f"{spec.name}{GROUP_POLICY_INFIX}{group}", "labels": labels},
             "spec": group_network_policy_spec(spec.name, group)} for group in range(spec.pods + 1)]


def workload(owner: dict[str, Any], spec: InferenceModelSpec, config: OperatorConfig) -> dict[str, Any]:
    """What runs the engine pods: a Deployment, or a LeaderWorkerSet of multi-node groups."""
    if multi_node(spec):
        return stamp_templates(leader_worker_set(_metadata(owner, spec), spec, config))
    return stamp_templates(deployment(owner, spec, config))


def desired_objects(owner: dict[str, Any], spec: InferenceModelSpec, config: OperatorConfig,
                    with_pool: bool) -> list[dict[str, Any]]:
    # The NetworkPolicy first: no engine pod exists before the policy that fences it in.
    objects = [network_policy(owner, spec, config)] if config.network_policy else []
    objects += [workload(owner, spec, config), service(owner, spec), pod_disruption_budget(owner, spec)]
    return objects + [inference_pool(owner, spec, config)] if with_pool else objects
