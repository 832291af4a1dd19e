"""Profiles by configuration: the default one from the flags (--scorer-weights, --routing), or those of an
EndpointPickerConfig file (--scheduler-config), in the Inference Extension's shape:

    plugins:                       # instances: type, optional name (default: the type), parameters
    - type: queue
    - {type: prefix, name: prefix}
    - {type: saturation, parameters: {queueThreshold: 8}}
    schedulingProfiles:
    - name: default
      plugins:                     # by reference; scorers take a weight (default 1)
      - pluginRef: saturation
      - {pluginRef: queue, weight: 2}
      - {pluginRef: prefix, weight: 4}

A profile's filters run in the order listed; without a picker it picks the highest score (max-score); a
profile handler is listed under `plugins` only (default: single-profile-handler, the first profile).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from . import plugins  # noqa: F401 -- registers the shipped plugin types
from .framework import PluginHandle, Profile, ProfileHandler, WeightedScorer
from .registry import create, kind_of

# The filters in front of every default profile, in the order that gives today's admission answers.
ADMISSION = ("ready", "subset", "exclude", "serves-model")
Profiles = tuple[ProfileHandler, dict[str, Profile]]


def default_profiles(weights: dict[str, float], policy: str, handle: PluginHandle) -> Profiles:
    """One profile from the flags: scored (admission, saturation, free slot; the weighted scorers; max-score),
    or round-robin (admission and shedding only; a rotation over every endpoint serving the model)."""
    admission = [create(name, {}, handle) for name in ADMISSION]
    if policy == "round-robin":
        profile = Profile("default", [*admission, create("saturation", {"preferUnsaturated": False}, handle)], [],
                          create("round-robin", {}, handle), handle.fallbacks)
    else:
        # Weight-0 scorers stay (not run): the prefix scorer still remembers where prompts go.
        scorers = [WeightedScorer(name, create(name, {}, handle), weight) for name, weight in weights.items()]
        profile = Profile("default", [*admission, create("saturation", {}, handle), create("free-slot", {}, handle)],
                          scorers, create("max-score", {}, handle), handle.fallbacks)
    return create("single-profile-handler", {}, handle), {profile.name: profile}


def configured_profiles(config: dict[str, Any], handle: PluginHandle) -> Profiles:
    """The profiles of an EndpointPickerConfig document; ValueError on anything it cannot build."""
    if not isinstance(config, dict):
        raise ValueError("the scheduler config must be a mapping with `plugins` and `schedulingProfiles`")
    instances, handler = {}, None
    for spec in config.get("plugins") or []:
        if not isinstance(spec, dict) or "type" not in spec:
            raise ValueError(f"scheduler config: a plugin needs a `type`: {spec!r}")
        name = spec.get("name") or spec["type"]
        if name in instances:
            raise ValueError(f"scheduler config: two plugins named `{name}`")
        instances[name] = (kind_of(spec["type"]), create(spec["type"], spec.get("parameters"), handle))
        if instances[name][0] == "profile-handler":
            if handler is not None:
                raise ValueError("scheduler config: more than one profile handler")
            handler = instances[name][1]
    profiles = {}
    for spec in config.get("schedulingProfiles") or []:
        name = spec.get("name") or "default"
        filters, scorers, picker = [], [], None
        for ref in spec.get("plugins") or []:
            ref_name = ref.get("pluginRef") if isinstance(ref, dict) else None
            if ref_name not in instances:
                raise ValueError(f"scheduler config: profile `{name}` refers to no plugin `{ref_name}`; "
                                 f"plugins: {', '.join(instances) or 'none'}")
            kind, plugin = instances[ref_name]
            if kind == "filter":
                filters.append(plugin)
            elif kind == "scorer":
                weight = float(ref.get("weight", 1.0))
                if weight < 0:
                    raise ValueError(f"scheduler config: scorer `{ref_name}` has a negative weight")
                scorers.append(WeightedScorer(ref_name, plugin, weight))
            elif kind == "picker" and picker is None:
                picker = plugin
            else:
                raise ValueError(f"scheduler config: profile `{name}` cannot take `{ref_name}` ({kind}): "
                                 "one picker per profile; profile handlers are listed under `plugins` only")
        profiles[name] = Profile(name, filters, scorers, picker or create("max-score", {}, handle), handle.fallbacks)
    if not profiles:
        raise ValueError("scheduler config: no `schedulingProfiles`")
    return handler or create("single-profile-handler", {}, handle), profiles


def read_config(path: str | Path) -> dict[str, Any]:
    """An EndpointPickerConfig file (YAML or JSON), checked by building it once."""
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--scheduler-config {path}: {error}") from None
    configured_profiles(config, PluginHandle())
    return config
