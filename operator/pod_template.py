"""The engine pod: container command line, resources, probes, volumes and security settings."""
from __future__ import annotations

import math
from typing import Any

from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.credentials import serving_env
from kubeinfer.operator.names import (ADAPTERS_ANNOTATION, ADAPTERS_DIR, GRPC_PORT, HTTP_PORT, MODEL_DIR,
                                      PLACEMENT_DIR, PLACEMENT_FILE, pod_labels, selector_labels)
from kubeinfer.operator.sources import FetchContext, Staging, stage_adapters, stage_model
from kubeinfer.operator.spec import InferenceModelSpec

UID = 1000  # the images' non-root user
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                      "capabilities": {"drop": ["ALL"]}}
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
                "seccompProfile": {"type": "RuntimeDefault"}}


def engine_args(spec: InferenceModelSpec) -> list[str]:
    """`kubeinfer serve` flags: the operator's first, then spec.engine.args."""
    args = ["serve", MODEL_DIR, "--host", "0.0.0.0", "--port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT),
            "--served-model-name", spec.served_name,
            # The gateway writes each request's priority into the body (gateway/handlers/request_info.py): honour it.
            "--scheduling-policy", "priority"]
    if spec.engine.resources.gpus > 0:
        args += ["--device", "cuda"]
    if spec.engine.max_model_len is not None:
        args += ["--max-model-len", str(spec.engine.max_model_len)]
    if spec.engine.dtype is not None:
        args += ["--dtype", spec.engine.dtype]
    if spec.adapters:
        pool = spec.adapter_pool
        args += ["--enable-lora", "--max-loras", str(pool.max_loras_per_replica), "--max-lora-rank",
                 str(pool.max_lora_rank), "--lora-catalog-dir", ADAPTERS_DIR, "--lora-placement-file", PLACEMENT_FILE]
    return args + list(spec.engine.args)


def drain_timeout(spec: InferenceModelSpec, default: int) -> float:
    """--drain-timeout from spec.engine.args when set there (`--drain-timeout N` or `--drain-timeout=N`)."""
    args = list(spec.engine.args)
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--drain-timeout=") else (
            args[i + 1] if arg == "--drain-timeout" and i + 1 < len(args) else None)
        if value is not None:
            try:
                return float(value)
            except ValueError:
                return default
    return default


def api_key_env(config: OperatorConfig) -> list[dict[str, Any]]:
    """The engine requires this key on /v1 (the gateway presents it); /health and /metrics stay open for probes
    and scrapers. The Secret must exist in the model's namespace: without it the pod does not start."""
    if not config.engine_api_key_secret:
        return []
    return [{"name": "KUBEINFER_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": config.engine_api_key_secret, "key": config.engine_api_key_secret_key}}}]


def resources(spec: InferenceModelSpec) -> dict[str, Any]:
    res = spec.engine.resources
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if res.gpus:
        requests[res.gpu_resource_name] = limits[res.gpu_resource_name] = res.gpus  # extended: both or neither
    if res.cpu is not None:
        requests["cpu"] = res.cpu
    if res.memory is not None:
        requests["memory"] = limits["memory"] = res.memory  # over-commit here means the OOM killer mid-request
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def probes(spec: InferenceModelSpec) -> dict[str, Any]:
    health = {"path": "/health", "port": "http"}
    startup_period = 10
    return {
        # Loading a large model takes minutes; liveness only starts once this has passed once.
        "startupProbe": {"httpGet": health, "periodSeconds": startup_period, "timeoutSeconds": 5,
                         "failureThreshold": math.ceil(spec.engine.startup_timeout_seconds / startup_period)},
        "readinessProbe": {"httpGet": health, "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 2},
        "livenessProbe": {"httpGet": health, "periodSeconds": 15, "timeoutSeconds": 5, "failureThreshold": 4},
    }


def staging(spec: InferenceModelSpec, image: str, config: OperatorConfig) -> Staging:
    ctx = FetchContext(engine_image=image, hf_image=config.hf_fetcher_image, s3_image=config.s3_fetcher_image,
                       env=spec.engine.env, security_context=CONTAINER_SECURITY)
    out = Staging([{"name": "tmp", "emptyDir": {}}], [{"name": "tmp", "mountPath": "/tmp"}])
    out.extend(stage_model(spec.model, ctx))
    out.extend(stage_adapters([(a.name, a.source) for a in spec.adapters], ctx))
    if spec.adapters:  # the placement the operator writes on the pod, as a file the engine polls
        field = f"metadata.annotations['{ADAPTERS_ANNOTATION}']"
        out.volumes.append({"name": "placement", "downwardAPI": {
            "items": [{"path": PLACEMENT_FILE.rsplit("/", 1)[1], "fieldRef": {"fieldPath": field}}]}})
        out.mounts.append({"name": "placement", "mountPath": PLACEMENT_DIR, "readOnly": True})
    if spec.engine.resources.gpus > 0:  # NCCL and CUDA IPC need more than the runtime's 64 MiB /dev/shm
        out.volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}})
        out.mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return out


def pod_template(spec: InferenceModelSpec, config: OperatorConfig) -> dict[str, Any]:
    image = spec.engine.image or config.engine_image
    staged = staging(spec, image, config)
    env = [*serving_env(spec.engine.env), {"name": "HOME", "value": "/tmp"}, {"name": "HF_HUB_OFFLINE", "value": "1"},
           *api_key_env(config)]
    drain = drain_timeout(spec, config.drain_timeout_seconds)
    container = {
        "name": "engine", "image": image, "command": ["kubeinfer"], "args": engine_args(spec), "env": env,
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                  {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"}],
        "resources": resources(spec), **probes(spec),
        # Endpoints drop the pod while it still serves, then SIGTERM starts the engine's drain.
        "lifecycle": {"preStop": {"sleep": {"seconds": config.pre_stop_seconds}}},
        "securityContext": CONTAINER_SECURITY, "volumeMounts": staged.mounts,
    }
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the engine never talks to the API server
        "enableServiceLinks": False,
        "securityContext": POD_SECURITY,
        "terminationGracePeriodSeconds": math.ceil(drain) + config.pre_stop_seconds + 10,
        "initContainers": staged.init_containers,
        "containers": [container],
        "volumes": staged.volumes,
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": selector_labels(spec.name)}}],
    }
    if spec.engine.node_selector:
        pod["nodeSelector"] = dict(spec.engine.node_selector)
    if spec.engine.tolerations:
        pod["tolerations"] = list(spec.engine.tolerations)
    if spec.engine.priority_class_name:
        pod["priorityClassName"] = spec.engine.priority_class_name
    if not pod["initContainers"]:
        del pod["initContainers"]
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT),
                   "prometheus.io/path": "/metrics"}
    return {"metadata": {"labels": pod_labels(spec.name), "annotations": annotations}, "spec": pod}
