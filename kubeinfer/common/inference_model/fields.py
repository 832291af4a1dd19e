"""The InferenceModel resource as typed values: what the operator and the gateway read from it.

The CRD (crds/inferencemodels.serving.kubeinfer.io.yaml) is the contract; each field below names the CRD field
it reads, and tests/common/test_inference_model_crd.py checks both agree on type, default and enum.
Sources (spec.model.uri, spec.adapters[].uri) are generic: the gateway keeps the URI as written, the operator
reads it into its own Source (where the files come from and how the pod gets them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

SourceT = TypeVar("SourceT")


@dataclass(frozen=True)
class Resources:
    """spec.engine.resources: what one engine pod asks for."""
    gpus: int = 0
    gpu_resource_name: str = "nvidia.com/gpu"
    cpu: str | None = None
    memory: str | None = None


@dataclass(frozen=True)
class Parallelism:
    """spec.engine.parallelism, KServe LLMInferenceService's shape: `tensor` ranks (GPUs) per pod, `nodes` pods
    per replica."""
    tensor: int = 1
    nodes: int = 1

    @property
    def world_size(self) -> int:
        """The engine's --tensor-parallel-size: tensor parallelism spans every rank of every node."""
        return self.tensor * self.nodes


@dataclass(frozen=True)
class EngineSpec:
    """spec.engine: the engine container."""
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
class Adapter(Generic[SourceT]):
    """One of spec.adapters: the model name clients send for it, and where its files are."""
    name: str
    source: SourceT


@dataclass(frozen=True)
class AdapterPool:
    """spec.adapterPool: how adapters spread over the active pods."""
    max_loras_per_replica: int = 4
    max_lora_rank: int = 64
    replicas_per_adapter: int = 1


@dataclass(frozen=True)
class Autoscaling:
    """spec.autoscaling (absent: off)."""
    target_queue_depth: float
    scale_down_delay_seconds: int = 300


@dataclass(frozen=True)
class Routing:
    """spec.routing: how the gateway treats the model's requests; kvEvents also shapes the engine pods."""
    priority: int = 0  # below 0: sheddable
    fallback: tuple[str, ...] = ()  # served names that take the requests, first that can serve wins
    kv_events: bool = False


@dataclass(frozen=True)
class InferenceModel(Generic[SourceT]):
    """One InferenceModel: metadata.name (and namespace where known) and its spec."""
    name: str
    model: SourceT  # spec.model.uri, as written or as the reading part parsed it
    served_name: str  # spec.model.servedName, else metadata.name
    engine: EngineSpec = field(default_factory=EngineSpec)
    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int | None = None
    standby: int = 0  # spec.standby.replicas
    adapters: tuple[Adapter[SourceT], ...] = ()
    adapter_pool: AdapterPool = field(default_factory=AdapterPool)
    autoscaling: Autoscaling | None = None
    routing: Routing = field(default_factory=Routing)
    namespace: str | None = None  # metadata.namespace, when read from a whole object

    @property
    def pods(self) -> int:
        """Serving units kept: active plus standby."""
        return self.replicas + self.standby

    @property
    def kv_events(self) -> bool:
        """spec.routing.kvEvents: the engines publish KV-cache events for the gateway's precise prefix routing."""
        return self.routing.kv_events

    @property
    def client_names(self) -> tuple[str, ...]:
        """The model names clients send for this model: its served name and each adapter's (empty ones left out)."""
        return tuple(name for name in (self.served_name, *(a.name for a in self.adapters)) if name)
