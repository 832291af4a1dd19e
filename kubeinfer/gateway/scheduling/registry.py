"""Scheduling plugins by type name: filters, scorers, pickers and profile handlers register here, and profiles
(profiles.py) are built from these names. One namespace for all kinds, as in the Inference Extension's
configuration, where a profile lists plugins by reference and their kind follows from their type.

    @register_scorer("queue")
    class QueueScorer(Scorer): ...

A factory is anything called as `factory(parameters, handle)` that returns the plugin: a plugin class, or a
function.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .framework import Plugin, PluginHandle

KINDS = ("filter", "scorer", "picker", "profile-handler")
Factory = Callable[[dict[str, Any], PluginHandle], Plugin]
_FACTORIES: dict[str, tuple[str, Factory]] = {}  # type name -> (kind, factory), in registration order


class UnknownPluginError(ValueError):
    pass


def register(kind: str, type_name: str, factory: Factory | None = None):
    """Register `factory` as plugin type `type_name`; without `factory`, a decorator."""
    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; choose one of {', '.join(KINDS)}")

    def add(made: Factory) -> Factory:
        if type_name in _FACTORIES:
            raise ValueError(f"scheduling plugin type {type_name!r} is already registered")
        _FACTORIES[type_name] = (kind, made)
        return made
    return add if factory is None else add(factory)


def register_filter(type_name: str, factory: Factory | None = None):
    return register("filter", type_name, factory)


def register_scorer(type_name: str, factory: Factory | None = None):
    return register("scorer", type_name, factory)


def register_picker(type_name: str, factory: Factory | None = None):
    return register("picker", type_name, factory)


def register_profile_handler(type_name: str, factory: Factory | None = None):
    return register("profile-handler", type_name, factory)


def unregister(type_name: str) -> None:
    """For tests that register a plugin of their own."""
    _FACTORIES.pop(type_name, None)


def registered(kind: str | None = None) -> list[str]:
    """Type names, in registration order; of one kind, or all."""
    return [name for name, (k, _) in _FACTORIES.items() if kind is None or k == kind]


def kind_of(type_name: str) -> str:
    if type_name not in _FACTORIES:
        raise UnknownPluginError(f"unknown scheduling plugin type {type_name!r}; registered: "
                                 + ", ".join(registered()))
    return _FACTORIES[type_name][0]


def create(type_name: str, parameters: dict[str, Any] | None, handle: PluginHandle) -> Plugin:
    kind_of(type_name)  # an unknown type fails with the list of known ones
    return _FACTORIES[type_name][1](dict(parameters or {}), handle)
