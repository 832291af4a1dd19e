"""Validate custom resources offline the way the API server would: defaults, structural schema, CEL.

The CRD's openAPIV3Schema is OpenAPI 3.0 with Kubernetes extensions; `json_schema` turns it into a
JSON Schema (2020-12) in which unknown fields are errors, as with `kubectl apply --validate=strict`.
`cel_violations` evaluates every `x-kubernetes-validations` rule with cel-python.
"""
from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

# OpenAPI 3.0 / Kubernetes keywords that JSON Schema does not have (or that only annotate).
_DROPPED = {"description", "default", "nullable", "format", "example", "externalDocs"}


def load_crd(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def version_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise KeyError(f"{crd['metadata']['name']} has no version {version}")


def json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """A strict JSON Schema equivalent of a structural schema node."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: json_schema(child) for name, child in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = json_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [json_schema(child) for child in value]
        elif key == "exclusiveMinimum" and value is True:
            out["exclusiveMinimum"] = node["minimum"]
        elif key == "exclusiveMaximum" and value is True:
            out["exclusiveMaximum"] = node["maximum"]
        elif key.startswith("x-kubernetes-") or key in _DROPPED:
            continue
        else:
            out[key] = value
    if node.get("exclusiveMinimum") is True:
        out.pop("minimum", None)
    if node.get("exclusiveMaximum") is True:
        out.pop("maximum", None)
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)  # its anyOf says integer or string
    if "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False  # the API server prunes (or, strict, rejects) unknown fields
    return out


def apply_defaults(node: dict[str, Any], value: Any) -> Any:
    """The object with the schema's defaults filled in, as the API server stores it."""
    value = copy.deepcopy(value)
    _default_into(node, value)
    return value


def _default_into(node: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for name, child in node.get("properties", {}).items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                _default_into(child, value[name])
        if isinstance(node.get("additionalProperties"), dict):
            for name in set(value) - set(node.get("properties", {})):
                _default_into(node["additionalProperties"], value[name])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            _default_into(node["items"], item)


def cel_violations(node: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Messages of every x-kubernetes-validations rule the value breaks (transition rules skipped)."""
    import celpy

    problems = []
    for rule in node.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue  # only meaningful on update
        if not _compiled(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)}):
            problems.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for name, child in node.get("properties", {}).items():
            if name in value:
                problems += cel_violations(child, value[name], f"{path}.{name}".lstrip("."))
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            problems += cel_violations(node["items"], item, f"{path}[{i}]")
    return problems


@lru_cache(maxsize=None)
def _compiled(rule: str):
    import celpy

    environment = celpy.Environment()
    return environment.program(environment.compile(rule))
