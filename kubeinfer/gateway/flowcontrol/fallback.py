"""Fallback models: where a request goes when its model cannot serve it.

Two sources, the static one first: `--fallback MODEL=OTHER` (repeatable, in order) and the
InferenceModels' `spec.routing.fallback: [OTHER, ...]` (watched by model_priorities.ClusterPriorities).
The router moves a request to the first fallback that can serve when its model has no ready pod, when
every pod of it is saturated, or (proxy mode) when every pod of it failed before the first byte. The
body's `model` is rewritten, so the engine's response names the model that served.
"""
from __future__ import annotations

from kubeinfer.common.inference_model import read_inference_model


def parse_fallback(text: str) -> tuple[str, str]:
    model, sep, other = text.partition("=")
    if not sep or not model.strip() or not other.strip():
        raise ValueError(f"--fallback takes MODEL=OTHER, got {text!r}")
    return model.strip(), other.strip()


def fallbacks_of(models: list[dict]) -> dict[str, list[str]]:
    """Served name -> its InferenceModel's `spec.routing.fallback` (models without one left out)."""
    out: dict[str, list[str]] = {}
    for obj in models:
        model, _ = read_inference_model(obj)  # the operator reports the problems; routing goes on
        if model.served_name and model.routing.fallback:
            out[model.served_name] = list(model.routing.fallback)
    return out


class Fallbacks:
    def __init__(self, static: list[tuple[str, str]] | None = None) -> None:
        self.static: dict[str, list[str]] = {}
        for model, other in static or []:
            self.static.setdefault(model, []).append(other)
        self.discovered: dict[str, list[str]] = {}  # kept current by ClusterPriorities

    def of(self, model: str) -> list[str]:
        """The fallbacks of `model`, in order, never the model itself."""
        return [m for m in self.static.get(model) or self.discovered.get(model) or [] if m != model]


def switch_model(request, model: str, reason: str, metrics) -> None:
    """`request` is served by `model` from now on (its body's `model` rewritten), counted under `reason`
    (saturated, no_ready_endpoint, failed) in kubeinfer_gateway_fallbacks."""
    requested = request.requested_model or request.model
    request.requested_model, request.model, request.hashes = requested, model, None
    request.exclude = frozenset()
    metrics.fallbacks.labels(requested, model, reason).inc()
