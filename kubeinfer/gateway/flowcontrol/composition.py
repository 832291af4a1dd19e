"""Which flow-control layers a request passes, in which order: the default composition from the flags (today's
wiring), or the layers of a FlowControlConfig file (--flow-control-config), in the shape of the scheduler's
EndpointPickerConfig (docs/gateway-plugins.md):

    kind: FlowControlConfig
    layers:                          # in the order a request passes them
    - type: tenants
    - type: tokenize
    - type: fallback
    - type: hold
      parameters: {maxHeld: 64}      # each parameter defaults to its flag
    - type: fair-queue

A layer listed is on; an unknown type, a layer listed twice or an unknown parameter stops the gateway at start.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..scheduling.picker import Decision, RoutingRequest
from . import layers  # noqa: F401 -- registers the shipped layer types
from .framework import Admission, FlowHandle, FlowLayer
from .registry import create, factory_of

# The order the router wired them in by hand before the composition; the default composition keeps it.
DEFAULT_LAYERS = ("tenants", "tokenize", "fallback", "hold", "fair-queue")


class FlowControl:
    """The composed layers, in order."""

    def __init__(self, layers: list[FlowLayer] | None = None) -> None:
        self.layers = list(layers or [])

    def __contains__(self, type_name: str) -> bool:
        return self.get(type_name) is not None

    def get(self, type_name: str) -> FlowLayer | None:
        return next((layer for layer in self.layers if layer.type_name == type_name), None)

    def put(self, type_name: str, layer: FlowLayer | None) -> None:
        """Replace the layer of that type in its place, or add it where the default order puts it; None
        removes it."""
        at = next((i for i, old in enumerate(self.layers) if old.type_name == type_name), None)
        if at is not None:
            del self.layers[at]
        if layer is None:
            return
        if at is None:
            rank = DEFAULT_LAYERS.index(type_name) if type_name in DEFAULT_LAYERS else len(DEFAULT_LAYERS)
            at = next((i for i, old in enumerate(self.layers) if old.type_name in DEFAULT_LAYERS
                       and DEFAULT_LAYERS.index(old.type_name) > rank), len(self.layers))
        self.layers.insert(at, layer)

    async def admit(self, admission: Admission) -> Decision | None:
        """Through every layer in order; a layer's decision (it picked) ends the walk."""
        for layer in self.layers:
            decision = await layer.admit(admission)
            if decision is not None:
                return decision
        return None

    def dispatched(self, request: RoutingRequest, decision: Decision, retry: bool = False) -> None:
        for layer in self.layers:
            layer.dispatched(request, decision, retry)

    def close(self) -> None:
        for layer in self.layers:
            layer.close()


class LayerSlot:
    """A router attribute that is a layer's state (`router.hold`, `router.tenants`, `router.fair_queue`): reading
    it gives the state of the composed layer of `type_name` (None when not composed); setting it composes that
    layer around the given state, in its default place (None removes the layer)."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def __get__(self, router, owner=None):
        if router is None:
            return self
        layer = router.flow.get(self.type_name)
        return getattr(layer, layer.state) if layer is not None and layer.state else None

    def __set__(self, router, value) -> None:
        layer = None if value is None else factory_of(self.type_name)({}, router.flow_handle, state=value)
        router.flow.put(self.type_name, layer)


def flag_parameters(config) -> dict[str, dict[str, Any]]:
    """Each layer's parameters from the gateway's flags (`config`: app.GatewayConfig)."""
    return {
        "tenants": {"file": config.tenants_file, "trustHeader": config.trust_tenant_header,
                    "limitScope": config.tenant_limit_scope, "replicas": config.gateway_replicas,
                    "usageLog": config.usage_log},
        "hold": {"maxHeld": config.hold_max, "timeout": config.hold_timeout},
        "fair-queue": {"maxPerTenant": config.fair_queue_max_per_tenant, "timeout": config.fair_queue_timeout,
                       "preempt": config.forward_priority},
    }


def default_layers(config) -> list[str]:
    """The flags' composition: tenants with --tenants or --usage-log, the fair queue with --fair-queue (on with
    --tenants unless --no-fair-queue); the others always (each does nothing until its data says so)."""
    on = {"tenants": bool(config.tenants_file or config.usage_log),
          "fair-queue": bool(config.fair_queue or (config.fair_queue is None and config.tenants_file))}
    return [name for name in DEFAULT_LAYERS if on.get(name, True)]


def check_layers(document: Any) -> list[dict[str, Any]]:
    """The `layers` of a FlowControlConfig document, checked; ValueError naming what is wrong."""
    if not isinstance(document, dict) or not isinstance(document.get("layers"), list):
        raise ValueError("the flow-control config must be a mapping with a `layers` list")
    seen, specs = set(), []
    for spec in document["layers"]:
        if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
            raise ValueError(f"flow-control config: a layer needs a `type`: {spec!r}")
        kind, parameters = spec["type"], spec.get("parameters") or {}
        factory = factory_of(kind)  # an unknown type fails with the list of registered ones
        if kind in seen:
            raise ValueError(f"flow-control config: layer `{kind}` is listed twice")
        seen.add(kind)
        known = getattr(factory, "parameter_names", frozenset())
        unknown = sorted(set(parameters) - set(known)) if isinstance(parameters, dict) else ["(not a mapping)"]
        if unknown:
            raise ValueError(f"flow-control config: layer `{kind}` takes no parameter {', '.join(unknown)}; "
                             f"it takes: {', '.join(sorted(known)) or 'none'}")
        specs.append({"type": kind, "parameters": dict(parameters)})
    return specs


def build_flow(config, handle: FlowHandle) -> FlowControl:
    """The gateway's layers: those of `config.flow_control` (a checked `layers` list) or the flags' default."""
    flags = flag_parameters(config)
    specs = config.flow_control if config.flow_control is not None else [{"type": t} for t in default_layers(config)]
    return FlowControl([create(spec["type"], {**flags.get(spec["type"], {}), **(spec.get("parameters") or {})},
                               handle) for spec in specs])


def read_flow_config(path: str | Path) -> list[dict[str, Any]]:
    """The layers of a FlowControlConfig file (YAML or JSON), checked."""
    try:
        document = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--flow-control-config {path}: {error}") from None
    return check_layers(document)
