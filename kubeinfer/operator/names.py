"""Names shared with the chart, the gateway and the engine: API groups, labels, annotations, ports."""
from __future__ import annotations

GROUP = "serving.kubeinfer.io"
VERSION = "v1alpha1"
PLURAL = "inferencemodels"
KIND = "InferenceModel"
API_VERSION = f"{GROUP}/{VERSION}"

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
POOL_PLURAL = "inferencepools"

# Labels on engine pods (the cross-component contract).
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MODEL_LABEL = f"{GROUP}/inference-model"
ROLE_LABEL = f"{GROUP}/role"
ENGINE_NAME = "kubeinfer-engine"
MANAGER = "kubeinfer-operator"
ACTIVE = "active"
STANDBY = "standby"
WORKER = "worker"  # a headless rank of a multi-node group: set by its template, never an endpoint

ADAPTERS_ANNOTATION = f"{GROUP}/adapters"
TEMPLATE_ANNOTATION = f"{GROUP}/pod-template"  # template_hash.py: which template a pod was made from
# The ReplicaSet controller deletes pods with the lowest cost first: standby before active.
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"

HTTP_PORT = 8000
GRPC_PORT = 8001
# spec.routing.kvEvents: the engine's KV-event PUB and replay sockets (vLLM's and the gateway's default port)
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558
MASTER_PORT = 29500  # torch.distributed's rendezvous on a multi-node group's leader
MODEL_DIR = "/models/model"
ADAPTERS_DIR = "/adapters"
PLACEMENT_DIR = "/etc/kubeinfer/placement"
PLACEMENT_FILE = f"{PLACEMENT_DIR}/adapters"


def selector_labels(name: str) -> dict[str, str]:
    """The Deployment's selector: immutable, so it never includes the role."""
    return {NAME_LABEL: ENGINE_NAME, INSTANCE_LABEL: name}


def pod_labels(name: str) -> dict[str, str]:
    return {**selector_labels(name), MANAGED_BY_LABEL: MANAGER, MODEL_LABEL: name}


def active_labels(name: str) -> dict[str, str]:
    """What the Service, the InferencePool and the gateway select: serving pods of one model."""
    return {**selector_labels(name), ROLE_LABEL: ACTIVE}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in labels.items())


def matches(labels: dict[str, str] | None, selector: dict[str, str]) -> bool:
    labels = labels or {}
    return all(labels.get(key) == value for key, value in selector.items())
