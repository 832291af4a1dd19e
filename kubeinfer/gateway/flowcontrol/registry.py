"""Flow-control layers by type name; a composition (composition.py) lists them in the order a request passes.

    @register_layer("hold")
    class HoldLayer(FlowLayer): ...

A factory is anything called as `factory(parameters, handle)` that returns the layer: a layer class, or a
function.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .framework import FlowHandle, FlowLayer

Factory = Callable[[dict[str, Any], FlowHandle], FlowLayer]
_FACTORIES: dict[str, Factory] = {}  # type name -> factory, in registration order


class UnknownLayerError(ValueError):
    pass


def register_layer(type_name: str, factory: Factory | None = None):
    """Register `factory` as layer type `type_name`; without `factory`, a decorator."""

    def add(made: Factory) -> Factory:
        if type_name in _FACTORIES:
            raise ValueError(f"flow-control layer type {type_name!r} is already registered")
        if isinstance(made, type) and issubclass(made, FlowLayer):
            made.type_name = type_name
        _FACTORIES[type_name] = made
        return made
    return add if factory is None else add(factory)


def unregister(type_name: str) -> None:
    """For tests that register a layer of their own."""
    _FACTORIES.pop(type_name, None)


def registered() -> list[str]:
    return list(_FACTORIES)


def factory_of(type_name: str) -> Factory:
    if type_name not in _FACTORIES:
        raise UnknownLayerError(f"unknown flow-control layer type {type_name!r}; registered: "
                                + ", ".join(registered()))
    return _FACTORIES[type_name]


def create(type_name: str, parameters: dict[str, Any] | None, handle: FlowHandle) -> FlowLayer:
    layer = factory_of(type_name)(dict(parameters or {}), handle)
    layer.type_name = layer.type_name or type_name
    return layer
