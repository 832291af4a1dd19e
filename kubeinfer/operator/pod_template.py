"""The engine pod: container command line, resources, probes, volumes and security settings.

A model on one node is one kind of pod. A model over several nodes (spec.engine.parallelism.nodes > 1) has two:
the leader, which is that same pod plus its place in the group, and the workers (`worker=True`), which run
headless ranks: no API, ports or probes, no adapter placement (the leader drives every step).
"""
from __future__ import annotations

import json
import math
from typing import Any

from kubeinfer.common.engine_key import ENGINE_KEY_ENV
from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.credentials import serving_env
from kubeinfer.operator.names import (ADAPTERS_ANNOTATION, ADAPTERS_DIR, GRPC_PORT, HTTP_PORT, KV_EVENTS_PORT,
                                      KV_REPLAY_PORT, MASTER_PORT, MODEL_DIR, PLACEMENT_DIR, PLACEMENT_FILE,
                                      ROLE_LABEL, WORKER, pod_labels, selector_labels)
from kubeinfer.operator.sources import FetchContext, Staging, stage_adapters, stage_model
from kubeinfer.operator.spec import InferenceModelSpec

UID = 1000  # the images' non-root user
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                      "capabilities": {"drop": ["ALL"]}}
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
                "seccompProfile": {"type": "RuntimeDefault"}}
# A failed start's last words reach the pod's status, where the operator reads them into the model's conditions
# (which every reader of the namespace sees). The engine's are only its own fatal error, which it writes to
# /dev/termination-log: never its log's tail, which can quote tenants' requests (issue #44). The fetch init
# containers (hf, aws) write no such file and see no request: their log's tail says why a download failed.
TERMINATION_MESSAGE = {"terminationMessagePolicy": "File"}
FETCH_TERMINATION_MESSAGE = {"terminationMessagePolicy": "FallbackToLogsOnError"}
# Set by the LeaderWorkerSet controller in every container of a group; the kubelet expands $(VAR) in args.
LEADER_ADDRESS, WORKER_INDEX = "$(LWS_LEADER_ADDRESS)", "$(LWS_WORKER_INDEX)"


def parallel_args(spec: InferenceModelSpec, worker: bool = False) -> list[str]:
    """Tensor parallelism over all tensor x nodes ranks; over several nodes, each pod's place in the group."""
    par = spec.engine.parallelism
    args = ["--tensor-parallel-size", str(par.world_size)] if par.world_size > 1 else []
    if par.nodes > 1:
        args += ["--nnodes", str(par.nodes), "--node-rank", WORKER_INDEX if worker else "0",
                 "--master-addr", LEADER_ADDRESS, "--master-port", str(MASTER_PORT)]
    return args + (["--headless"] if worker else [])


def kv_events_config() -> str:
    """spec.routing.kvEvents: vLLM's keys, on the ports the NetworkPolicy opens to the gateway (its default 5557)."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
                       "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}"}, separators=(",", ":"))


def engine_args(spec: InferenceModelSpec, worker: bool = False) -> list[str]:
    """`kubeinfer serve` flags: the operator's first, then spec.engine.args (workers build the same model)."""
    args = ["serve", MODEL_DIR, "--host", "0.0.0.0", "--port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT),
            "--served-model-name", spec.served_name,
            # The gateway writes each request's priority into the body (kubeinfer/gateway/handlers/request_info.py):
            # honour it.
            "--scheduling-policy", "priority"]
    if spec.engine.resources.gpus > 0:
        args += ["--device", "cuda"]
    args += parallel_args(spec, worker)
    if spec.engine.max_model_len is not None:
        args += ["--max-model-len", str(spec.engine.max_model_len)]
    if spec.engine.dtype is not None:
        args += ["--dtype", spec.engine.dtype]
    if spec.adapters:
        pool = spec.adapter_pool
        args += ["--enable-lora", "--max-loras", str(pool.max_loras_per_replica), "--max-lora-rank",
                 str(pool.max_lora_rank)]
        if not worker:  # placement is the leader's: it loads adapters on every rank of its group
            args += ["--lora-catalog-dir", ADAPTERS_DIR, "--lora-placement-file", PLACEMENT_FILE]
    if spec.kv_events and not worker:  # the leader's scheduler owns the blocks; headless ranks have none to report
        args += ["--kv-events-config", kv_events_config()]
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
    return [{"name": ENGINE_KEY_ENV, "valueFrom": {"secretKeyRef": {
        "name": config.engine_api_key_secret, "key": config.engine_api_key_secret_key}}}]


def kv_events_env(spec: InferenceModelSpec, worker: bool) -> list[dict[str, Any]]:
    """The engine names its events address in /load with its pod's IP for the `*` it binds (POD_IP, else its
    hostname's address)."""
    if not spec.kv_events or worker:
        return []
    return [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]


def kv_events_ports(spec: InferenceModelSpec) -> list[dict[str, Any]]:
    if not spec.kv_events:
        return []
    return [{"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
            {"name": "kv-replay", "containerPort": KV_REPLAY_PORT, "protocol": "TCP"}]


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


def staging(spec: InferenceModelSpec, image: str, config: OperatorConfig, worker: bool = False) -> Staging:
    ctx = FetchContext(engine_image=image, hf_image=config.hf_fetcher_image, s3_image=config.s3_fetcher_image,
                       env=spec.engine.env, security_context=CONTAINER_SECURITY)
    out = Staging([{"name": "tmp", "emptyDir": {}}], [{"name": "tmp", "mountPath": "/tmp"}])
    out.extend(stage_model(spec.model, ctx))
    model_claim = {spec.model.location: "model"} if spec.model.scheme == "pvc" else {}  # adapters beside it share it
    out.extend(stage_adapters([(a.name, a.source) for a in spec.adapters], ctx, model_claim))
    if spec.adapters and not worker:  # the placement the operator writes on the pod, as a file the engine polls
        field = f"metadata.annotations['{ADAPTERS_ANNOTATION}']"
        out.volumes.append({"name": "placement", "downwardAPI": {
            "items": [{"path": PLACEMENT_FILE.rsplit("/", 1)[1], "fieldRef": {"fieldPath": field}}]}})
        out.mounts.append({"name": "placement", "mountPath": PLACEMENT_DIR, "readOnly": True})
    # NCCL, CUDA IPC and the hand-off of each step to the other ranks need more than the runtime's 64 MiB /dev/shm
    if spec.engine.resources.gpus > 0 or spec.engine.parallelism.world_size > 1:
        out.volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}})
        out.mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return out


def pod_template(spec: InferenceModelSpec, config: OperatorConfig, worker: bool = False) -> dict[str, Any]:
    image = spec.engine.image or config.engine_image
    staged = staging(spec, image, config, worker)
    env = [*serving_env(spec.engine.env), {"name": "HOME", "value": "/tmp"}, {"name": "HF_HUB_OFFLINE", "value": "1"},
           *api_key_env(config), *kv_events_env(spec, worker)]
    drain = drain_timeout(spec, config.drain_timeout_seconds)
    container: dict[str, Any] = {
        "name": "engine", "image": image, "command": ["kubeinfer"], "args": engine_args(spec, worker), "env": env}
    if worker:
        # A headless rank serves nothing and has no /health; it must outlive its leader's drain, whose
        # in-flight requests still need every rank (a dead rank ends the group and its pod restarts it).
        container |= {"resources": resources(spec),
                      "lifecycle": {"preStop": {"sleep": {"seconds": math.ceil(drain) + config.pre_stop_seconds}}}}
    else:
        container |= {
            "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                      {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"}, *kv_events_ports(spec)],
            "resources": resources(spec), **probes(spec),
            # Endpoints drop the pod while it still serves, then SIGTERM starts the engine's drain.
            "lifecycle": {"preStop": {"sleep": {"seconds": config.pre_stop_seconds}}}}
    container |= {"securityContext": CONTAINER_SECURITY, "volumeMounts": staged.mounts, **TERMINATION_MESSAGE}
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the engine never talks to the API server
        "enableServiceLinks": False,
        "securityContext": POD_SECURITY,
        "terminationGracePeriodSeconds": math.ceil(drain) + config.pre_stop_seconds + 10,
        "initContainers": [{**c, **FETCH_TERMINATION_MESSAGE} for c in staged.init_containers],
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
    labels = pod_labels(spec.name)
    if worker:  # never an endpoint: the gateway and every selector of active pods leave workers out
        labels[ROLE_LABEL] = WORKER
        annotations = {}
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod}
