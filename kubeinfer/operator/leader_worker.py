"""A model over several nodes: one LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) instead of a Deployment.

Each replica (active or standby) is a group of spec.engine.parallelism.nodes pods that the LeaderWorkerSet
controller (lws.sigs.k8s.io) creates, names and restarts together: the leader `NAME-lws-G` serves the API as
rank 0 of node 0, and the workers `NAME-lws-G-W` run headless ranks of node W. The controller labels every
pod with its group and index and gives every container LWS_LEADER_ADDRESS (the leader's name in the
headless Service it creates, called after the LeaderWorkerSet: hence `-lws`, never the model's own Service
name) and LWS_WORKER_INDEX, which the kubelet expands in the engine's args (`$(VAR)`, no shell needed).
A group is the unit of everything else (groups.py): roles, adapter placement, status and /scale. Its ranks
authenticate each other with the model's group secret (group_secret.py); its ports admit only its own pods
(network_policy.group_network_policy_spec).
"""
from __future__ import annotations

from typing import Any

from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.group_secret import tp_secret_env
from kubeinfer.operator.pod_template import pod_template
from kubeinfer.operator.spec import InferenceModelSpec

LWS_GROUP, LWS_VERSION, LWS_PLURAL, LWS_KIND = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet"
LWS_API_VERSION = f"{LWS_GROUP}/{LWS_VERSION}"
# The controller's labels on every pod of a group (lws.sigs.k8s.io reference: labels and annotations).
SET_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_MISSING = "LeaderWorkerSetMissing"
LWS_INSTALL = "https://lws.sigs.k8s.io/docs/installation/"


def lws_name(model: str) -> str:
    return f"{model}-lws"


def multi_node(spec: InferenceModelSpec) -> bool:
    return spec.engine.parallelism.nodes > 1


def leader_worker_set(metadata: dict[str, Any], spec: InferenceModelSpec, config: OperatorConfig) -> dict[str, Any]:
    """replicas + standby groups of `nodes` pods; a pod that fails or restarts brings its whole group back."""
    max_unavailable = 1 if spec.standby > 0 else 0  # as the Deployment: a ready standby group covers one
    return {
        "apiVersion": LWS_API_VERSION, "kind": LWS_KIND, "metadata": {**metadata, "name": lws_name(spec.name)},
        "spec": {
            "replicas": spec.pods,
            "startupPolicy": "LeaderCreated",  # workers start with their leader: all ranks load the model at once
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {
                "maxSurge": 1, "maxUnavailable": max_unavailable}},
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": spec.engine.parallelism.nodes,
                # A lost rank leaves the others waiting in a collective: only a fresh group can serve again.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": with_group_secret(pod_template(spec, config), spec.name),
                "workerTemplate": with_group_secret(pod_template(spec, config, worker=True), spec.name),
            },
        },
    }


def with_group_secret(template: dict[str, Any], model: str) -> dict[str, Any]:
    """Every rank of a group proves the model's group secret to the others (group_secret.py)."""
    for container in template["spec"]["containers"]:
        container["env"] = [*container.get("env", []), *tp_secret_env(model)]
    return template


def lws_missing_message(spec: InferenceModelSpec) -> str:
    return (f"spec.engine.parallelism.nodes is {spec.engine.parallelism.nodes}: a replica over several nodes is a "
            f"LeaderWorkerSet ({LWS_API_VERSION}), which this cluster does not serve; install the LeaderWorkerSet "
            f"controller and its CRD ({LWS_INSTALL}), or set nodes to 1; checked again every minute")
