"""An InferenceModel spec as typed values, checked for what the CRD schema cannot say.

The API server already applied the CRD's defaults and checks; the defaults are repeated here so the
operator behaves the same on objects stored before a default existed (a test keeps both equal).
spec.routing is the gateway's business: it reads it from the InferenceModel itself, except routing.kvEvents,
which makes the engines publish the KV-cache events the gateway's precise prefix routing follows.
Everything wrong is reported at once in one SpecError, each problem naming its field.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kubeinfer.operator.owned_args import args_problems, env_problems
from kubeinfer.operator.sources import Source, SourceError, parse_source

DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
ADAPTER_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DTYPES = ("auto", "float16", "bfloat16", "float32")
MAX_TENSOR = 16  # the CRD's cap on resources.gpus: one rank per GPU
MAX_NODES = 64
# LeaderWorkerSet NAME-lws makes StatefulSets NAME-lws-GROUP whose revision-hash label adds 11 characters
# (at most 63), and pods NAME-lws-GROUP-WORKER whose hostnames must be DNS labels.
MAX_MULTI_NODE_NAME = 40
QUANTITY = re.compile(r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$")


class SpecError(ValueError):
    """The spec cannot be served as written; the message lists every problem and its field."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Resources:
    gpus: int = 0
    gpu_resource_name: str = "nvidia.com/gpu"
    cpu: str | None = None
    memory: str | None = None


@dataclass(frozen=True)
class Parallelism:
    """KServe LLMInferenceService's shape: `tensor` ranks (GPUs) per pod, `nodes` pods per replica."""
    tensor: int = 1
    nodes: int = 1

    @property
    def world_size(self) -> int:
        """The engine's --tensor-parallel-size: tensor parallelism spans every rank of every node."""
        return self.tensor * self.nodes


@dataclass(frozen=True)
class EngineSpec:
    image: str | None = None
    args: tuple[str, ...] = ()
    env: tuple[dict[str, Any], ...] = ()
    resources: Resources = field(default_factory=Resources)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    priority_class_name: str | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    startup_timeout_seconds: int = 1800
    parallelism: Parallelism = field(default_factory=Parallelism)


@dataclass(frozen=True)
class Adapter:
    name: str
    source: Source


@dataclass(frozen=True)
class AdapterPool:
    max_loras_per_replica: int = 4
    max_lora_rank: int = 64
    replicas_per_adapter: int = 1


@dataclass(frozen=True)
class Autoscaling:
    target_queue_depth: float
    scale_down_delay_seconds: int = 300


@dataclass(frozen=True)
class InferenceModelSpec:
    name: str
    model: Source
    served_name: str
    engine: EngineSpec = field(default_factory=EngineSpec)
    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int | None = None
    standby: int = 0
    adapters: tuple[Adapter, ...] = ()
    adapter_pool: AdapterPool = field(default_factory=AdapterPool)
    autoscaling: Autoscaling | None = None
    kv_events: bool = False  # spec.routing.kvEvents

    @property
    def pods(self) -> int:
        return self.replicas + self.standby


def _int(value: Any, where: str, problems: list[str], minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        problems.append(f"{where} must be an integer >= {minimum}, got {value!r}")
        return minimum
    return value


def _source(uri: Any, where: str, problems: list[str]) -> Source | None:
    try:
        return parse_source(uri)
    except SourceError as err:
        problems.append(f"{where}: {err}")
        return None


def _engine(raw: dict[str, Any], problems: list[str]) -> EngineSpec:
    res = raw.get("resources") or {}
    args = tuple(str(a) for a in raw.get("args") or ())
    env = tuple(raw.get("env") or ())
    problems += args_problems(args) + env_problems(env)
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


def _adapters(raw: list[dict[str, Any]], problems: list[str]) -> tuple[Adapter, ...]:
    adapters, seen = [], set()
    for i, item in enumerate(raw):
        name = item.get("name", "")
        if not isinstance(name, str) or not ADAPTER_NAME.match(name) or len(name) > 63:
            problems.append(f"spec.adapters[{i}].name {name!r} must be a DNS label (a-z, 0-9, '-', at most 63)")
            continue
        if name in seen:
            problems.append(f"spec.adapters[{i}].name {name!r} is used twice; adapter names must be unique")
        seen.add(name)
        source = _source(item.get("uri"), f"spec.adapters[{i}].uri", problems)
        if source is not None:
            adapters.append(Adapter(name, source))
    return tuple(adapters)


def parse_spec(name: str, spec: dict[str, Any]) -> InferenceModelSpec:
    """The typed spec of InferenceModel `name`, or SpecError listing every problem."""
    problems: list[str] = []
    if not DNS_LABEL.match(name) or len(name) > 63:
        problems.append(f"metadata.name {name!r} must be a DNS label (it names the Service and labels pods)")
    model = spec.get("model") or {}
    source = _source(model.get("uri"), "spec.model.uri", problems)
    engine = _engine(spec.get("engine") or {}, problems)
    if engine.parallelism.nodes > 1 and len(name) > MAX_MULTI_NODE_NAME:
        problems.append(f"metadata.name {name!r} must be at most {MAX_MULTI_NODE_NAME} characters with "
                        "spec.engine.parallelism.nodes > 1 (it names the LeaderWorkerSet, its StatefulSets and pods)")
    replicas = _int(spec.get("replicas", 1), "spec.replicas", problems)
    min_replicas = _int(spec.get("minReplicas", 1), "spec.minReplicas", problems)
    max_raw = spec.get("maxReplicas")
    max_replicas = None if max_raw is None else _int(max_raw, "spec.maxReplicas", problems, 1)
    if replicas < min_replicas:
        problems.append(f"spec.replicas ({replicas}) must be at least spec.minReplicas ({min_replicas})")
    if max_replicas is not None and not min_replicas <= replicas <= max_replicas:
        problems.append(f"spec.replicas ({replicas}) must be within spec.minReplicas..spec.maxReplicas "
                        f"({min_replicas}..{max_replicas})")
    pool = spec.get("adapterPool") or {}
    adapter_pool = AdapterPool(
        max_loras_per_replica=_int(pool.get("maxLorasPerReplica", 4), "spec.adapterPool.maxLorasPerReplica",
                                   problems, 1),
        max_lora_rank=_int(pool.get("maxLoraRank", 64), "spec.adapterPool.maxLoraRank", problems, 1),
        replicas_per_adapter=_int(pool.get("replicasPerAdapter", 1), "spec.adapterPool.replicasPerAdapter",
                                  problems, 1))
    autoscaling = None
    if (auto := spec.get("autoscaling")) is not None:
        target = auto.get("targetQueueDepth")
        if isinstance(target, bool) or not isinstance(target, (int, float)) or target <= 0:
            problems.append(f"spec.autoscaling.targetQueueDepth must be a number > 0, got {target!r}")
        elif max_replicas is None:
            problems.append("spec.autoscaling needs spec.maxReplicas (the autoscaler's upper bound)")
        else:
            autoscaling = Autoscaling(float(target), _int(auto.get("scaleDownDelaySeconds", 300),
                                                          "spec.autoscaling.scaleDownDelaySeconds", problems))
    standby = _int((spec.get("standby") or {}).get("replicas", 0), "spec.standby.replicas", problems)
    adapters = _adapters(spec.get("adapters") or [], problems)
    kv_events = (spec.get("routing") or {}).get("kvEvents", False)
    if not isinstance(kv_events, bool):
        problems.append(f"spec.routing.kvEvents must be true or false, got {kv_events!r}")
    if problems or source is None:
        raise SpecError(problems or ["spec.model.uri is required"])
    return InferenceModelSpec(
        name=name, model=source, served_name=model.get("servedName") or name, engine=engine, replicas=replicas,
        min_replicas=min_replicas, max_replicas=max_replicas, standby=standby, adapters=adapters,
        adapter_pool=adapter_pool, autoscaling=autoscaling, kv_events=kv_events is True)
