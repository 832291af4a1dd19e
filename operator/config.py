"""Operator-wide settings: what a cluster admin chooses once (images, the gateway), not per model."""
from __future__ import annotations

from dataclasses import dataclass

from kubeinfer import __version__ as _version


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

