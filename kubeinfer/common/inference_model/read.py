"""Reading an InferenceModel's dict into the typed model, every problem named by its field.

The API server already applied the CRD's defaults and checks; the defaults are repeated here so both parts
behave the same on objects stored before a default existed (tests/common keeps them equal to the CRD's).
The reading never raises: a value it cannot use is a problem ("spec.replicas must be ...") and reads as the
lowest value it may take, so the gateway keeps reading a model whose spec the operator refuses (the operator
refuses on any problem). spec.routing.priority and .fallback are the gateway's alone: read as it always read
them, never a problem. Each part reads sources its own way (`source`), and the operator adds the checks only
it knows (`engine_checks`: the flags and variables it owns).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from .fields import (Adapter, AdapterPool, Autoscaling, EngineSpec, InferenceModel, Parallelism, Resources, Routing,
                     SourceT)

DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
ADAPTER_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DTYPES = ("auto", "float16", "bfloat16", "float32")
MAX_TENSOR = 16  # the CRD's cap on resources.gpus: one rank per GPU
MAX_NODES = 64
# LeaderWorkerSet NAME-lws makes StatefulSets NAME-lws-GROUP whose revision-hash label adds 11 characters
# (at most 63), and pods NAME-lws-GROUP-WORKER whose hostnames must be DNS labels.
MAX_MULTI_NODE_NAME = 40
QUANTITY = re.compile(r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$")

SourceReader = Callable[[Any], SourceT]  # raises ValueError saying what is wrong with the URI
EngineChecks = Callable[[tuple[str, ...], tuple[dict[str, Any], ...]], list[str]]  # (args, env) -> problems


def uri_of(uri: Any) -> str:
    """The plain reading of a source: the URI as written (the API server checked the CRD's pattern)."""
    if not isinstance(uri, str) or not uri:
        raise ValueError(f"{uri!r} is not a URI")
    return uri


def _int(value: Any, where: str, problems: list[str], minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        problems.append(f"{where} must be an integer >= {minimum}, got {value!r}")
        return minimum
    return value


def _source(read: SourceReader, uri: Any, where: str, problems: list[str]) -> Any:
    try:
        return read(uri)
    except ValueError as err:
        problems.append(f"{where}: {err}")
        return None


def _engine(raw: dict[str, Any], problems: list[str], checks: EngineChecks | None) -> EngineSpec:
    res = raw.get("resources") or {}
    args = tuple(str(a) for a in raw.get("args") or ())
    env = tuple(raw.get("env") or ())
    if checks is not None:
        problems += checks(args, env)
    for key in ("cpu", "memory"):
        if res.get(key) is not None and not QUANTITY.match(str(res[key])):
            problems.append(f"spec.engine.resources.{key} {res[key]!r} is not a Kubernetes quantity "
                            "(e.g. 4, 500m, 32Gi)")
    dtype = raw.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        problems.append(f"spec.engine.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    max_len = raw.get("maxModelLen")
    gpus = _int(res.get("gpus", 0), "spec.engine.resources.gpus", problems)
    return EngineSpec(
        image=raw.get("image") or None, args=args, env=env,
        resources=Resources(gpus=gpus,
                            gpu_resource_name=res.get("gpuResourceName") or "nvidia.com/gpu",
                            cpu=None if res.get("cpu") is None else str(res["cpu"]),
                            memory=None if res.get("memory") is None else str(res["memory"])),
        node_selector=dict(raw.get("nodeSelector") or {}), tolerations=tuple(raw.get("tolerations") or ()),
        priority_class_name=raw.get("priorityClassName") or None,
        max_model_len=None if max_len is None else _int(max_len, "spec.engine.maxModelLen", problems, 1),
        dtype=dtype, startup_timeout_seconds=_int(raw.get("startupTimeoutSeconds", 1800),
                                                  "spec.engine.startupTimeoutSeconds", problems, 60),
        parallelism=_parallelism(raw.get("parallelism") or {}, gpus, problems))


def _parallelism(raw: dict[str, Any], gpus: int, problems: list[str]) -> Parallelism:
    """tensor defaults to the pod's GPUs (1 on the CPU), so `gpus: 4` alone uses all four."""
    tensor = _int(raw.get("tensor", max(gpus, 1)), "spec.engine.parallelism.tensor", problems, 1)
    nodes = _int(raw.get("nodes", 1), "spec.engine.parallelism.nodes", problems, 1)
    if tensor > MAX_TENSOR:
        problems.append(f"spec.engine.parallelism.tensor must be at most {MAX_TENSOR}, got {tensor}")
    if nodes > MAX_NODES:
        problems.append(f"spec.engine.parallelism.nodes must be at most {MAX_NODES}, got {nodes}")
    if gpus > 0 and tensor > gpus:
        problems.append(f"spec.engine.parallelism.tensor ({tensor}) must be at most spec.engine.resources.gpus "
                        f"({gpus}): each rank needs a GPU of its own")
    return Parallelism(tensor, nodes)


def _adapters(raw: list[Any], problems: list[str], read: SourceReader) -> tuple[Adapter[Any], ...]:
    adapters: list[Adapter[Any]] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            problems.append(f"spec.adapters[{i}] must be an object with a name and a uri, got {item!r}")
            continue
        name = item.get("name", "")
        if not isinstance(name, str) or not ADAPTER_NAME.match(name) or len(name) > 63:
            problems.append(f"spec.adapters[{i}].name {name!r} must be a DNS label (a-z, 0-9, '-', at most 63)")
            if isinstance(name, str) and name:
                adapters.append(Adapter(name, None))  # still a name clients send, to the gateway
            continue
        if name in seen:
            problems.append(f"spec.adapters[{i}].name {name!r} is used twice; adapter names must be unique")
        seen.add(name)
        adapters.append(Adapter(name, _source(read, item.get("uri"), f"spec.adapters[{i}].uri", problems)))
    return tuple(adapters)


def _replicas(spec: Mapping[str, Any], problems: list[str]) -> tuple[int, int, int | None]:
    replicas = _int(spec.get("replicas", 1), "spec.replicas", problems)
    min_replicas = _int(spec.get("minReplicas", 1), "spec.minReplicas", problems)
    max_raw = spec.get("maxReplicas")
    max_replicas = None if max_raw is None else _int(max_raw, "spec.maxReplicas", problems, 1)
    if replicas < min_replicas:
        problems.append(f"spec.replicas ({replicas}) must be at least spec.minReplicas ({min_replicas})")
    if max_replicas is not None and not min_replicas <= replicas <= max_replicas:
        problems.append(f"spec.replicas ({replicas}) must be within spec.minReplicas..spec.maxReplicas "
                        f"({min_replicas}..{max_replicas})")
    return replicas, min_replicas, max_replicas


def _adapter_pool(pool: Mapping[str, Any], problems: list[str]) -> AdapterPool:
    return AdapterPool(
        max_loras_per_replica=_int(pool.get("maxLorasPerReplica", 4), "spec.adapterPool.maxLorasPerReplica",
                                   problems, 1),
        max_lora_rank=_int(pool.get("maxLoraRank", 64), "spec.adapterPool.maxLoraRank", problems, 1),
        replicas_per_adapter=_int(pool.get("replicasPerAdapter", 1), "spec.adapterPool.replicasPerAdapter",
                                  problems, 1))


def _autoscaling(auto: Mapping[str, Any] | None, max_replicas: int | None,
                 problems: list[str]) -> Autoscaling | None:
    if auto is None:
        return None
    target = auto.get("targetQueueDepth")
    if isinstance(target, bool) or not isinstance(target, (int, float)) or target <= 0:
        problems.append(f"spec.autoscaling.targetQueueDepth must be a number > 0, got {target!r}")
        return None
    if max_replicas is None:  # the one problem to fix first: the delay is checked once it is
        problems.append("spec.autoscaling needs spec.maxReplicas (the autoscaler's upper bound)")
    return Autoscaling(float(target), _int(auto.get("scaleDownDelaySeconds", 300),
                                           "spec.autoscaling.scaleDownDelaySeconds",
                                           problems if max_replicas is not None else []))


def _gateway_int(value: Any) -> int:
    """spec.routing.priority as the gateway always read it: null or unreadable is 0."""
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _routing(raw: Mapping[str, Any], problems: list[str]) -> Routing:
    kv_events = raw.get("kvEvents", False)
    if not isinstance(kv_events, bool):
        problems.append(f"spec.routing.kvEvents must be true or false, got {kv_events!r}")
    fallback = raw.get("fallback") or []
    return Routing(priority=_gateway_int(raw.get("priority", 0)),
                   fallback=tuple(str(m) for m in (fallback if isinstance(fallback, list) else []) if m),
                   kv_events=kv_events is True)


def read_spec(name: str, spec: Mapping[str, Any] | None, *, namespace: str | None = None,
              source: SourceReader = uri_of,
              engine_checks: EngineChecks | None = None) -> tuple[InferenceModel[Any], list[str]]:
    """The typed InferenceModel `name` and the problems found (empty: servable as written). A source the
    reading could not read is None, and a problem."""
    spec = spec or {}
    problems: list[str] = []
    if not isinstance(name, str) or not DNS_LABEL.match(name) or len(name) > 63:
        problems.append(f"metadata.name {name!r} must be a DNS label (it names the Service and labels pods)")
    model = spec.get("model") or {}
    base = _source(source, model.get("uri"), "spec.model.uri", problems)
    engine = _engine(spec.get("engine") or {}, problems, engine_checks)
    if engine.parallelism.nodes > 1 and len(name) > MAX_MULTI_NODE_NAME:
        problems.append(f"metadata.name {name!r} must be at most {MAX_MULTI_NODE_NAME} characters with "
                        "spec.engine.parallelism.nodes > 1 (it names the LeaderWorkerSet, its StatefulSets and pods)")
    replicas, min_replicas, max_replicas = _replicas(spec, problems)
    adapter_pool = _adapter_pool(spec.get("adapterPool") or {}, problems)
    autoscaling = _autoscaling(spec.get("autoscaling"), max_replicas, problems)
    standby = _int((spec.get("standby") or {}).get("replicas", 0), "spec.standby.replicas", problems)
    adapters = _adapters(spec.get("adapters") or [], problems, source)
    routing = _routing(spec.get("routing") or {}, problems)
    return InferenceModel(
        name=name, model=base, served_name=model.get("servedName") or name, engine=engine, replicas=replicas,
        min_replicas=min_replicas, max_replicas=max_replicas, standby=standby, adapters=adapters,
        adapter_pool=adapter_pool, autoscaling=autoscaling, routing=routing, namespace=namespace), problems


def read_inference_model(obj: Mapping[str, Any], *, source: SourceReader = uri_of,
                         engine_checks: EngineChecks | None = None) -> tuple[InferenceModel[Any], list[str]]:
    """read_spec of a whole InferenceModel object (as listed or watched): its name and namespace too."""
    meta = obj.get("metadata") or {}
    return read_spec(meta.get("name") or "", obj.get("spec"), namespace=meta.get("namespace"), source=source,
                     engine_checks=engine_checks)
