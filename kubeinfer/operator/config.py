"""Operator-wide settings: what a cluster admin chooses once (images, the gateway), not per model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kubeinfer import __version__ as _version
from kubeinfer.operator.policy import PodPolicy


@dataclass(frozen=True)
class OperatorConfig:
    engine_image: str = f"ghcr.io/kubeinfer/engine:{_version}"
    # hf:// is fetched with the engine image's own `hf` CLI (huggingface_hub comes with transformers).
    hf_fetcher_image: str = ""
    s3_fetcher_image: str = "amazon/aws-cli:2.15.0"
    # The endpoint picker Service every InferencePool points at (the chart's gateway).
    endpoint_picker_service: str = "kubeinfer-gateway"
    endpoint_picker_port: int = 9002
    # Seconds between level-based passes over every model (roles, placement, status, autoscaling).
    resync_seconds: float = 15.0
    # The engine's default --drain-timeout, used unless spec.engine.args sets one (sizes the grace period).
    drain_timeout_seconds: int = 30
    pre_stop_seconds: int = 5
    # What InferenceModels may ask of the node (host paths, images, scheduling): policy.py.
    policy: PodPolicy = field(default_factory=PodPolicy)
    # The Secret (in each model's namespace) whose key engines require on /v1: the one the gateway presents.
    # Empty: engines take requests without a key (only for clusters where nothing else can reach them).
    engine_api_key_secret: str = ""
    engine_api_key_secret_key: str = "api-key"
    # The key itself, for the operator's own /v1/models reads (the chart gives it from the same Secret).
    engine_api_key: str = field(default="", repr=False)
    # A NetworkPolicy per model: engine API ports only from api_peers, the metrics (HTTP) port from metrics_peers.
    network_policy: bool = True
    api_peers: tuple[dict[str, Any], ...] = ()  # empty: gateway and operator pods in the model's namespace
    metrics_peers: tuple[dict[str, Any], ...] = ()
    kv_events_peers: tuple[dict[str, Any], ...] = ()  # KV-event ports; empty: gateway pods in the model's namespace
