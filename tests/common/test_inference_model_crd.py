"""The typed InferenceModel (kubeinfer.common.inference_model) against the CRD in crds/: every spec field the
reading reads exists in the CRD's openAPIV3Schema with the same type, default and enum, and every CRD spec
field is either read or listed in UNREAD with why, so a new CRD field forces a decision here.

Which fields the reading reads is observed, not declared: the spec is handed over as dicts that record each
key asked for. A field whose value is kept whole (engine.env, engine.tolerations) covers what is under it.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubeinfer.common.inference_model import InferenceModel, read_spec
from kubeinfer.common.inference_model.read import DTYPES

CRD = yaml.safe_load((Path(__file__).parents[2] / "crds" / "inferencemodels.serving.kubeinfer.io.yaml").read_text())
SPEC = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]

# CRD spec fields that neither the operator nor the gateway reads, and why. A field added to the CRD lands
# here or in the reading (and ATTRIBUTES).
UNREAD = {
    "spec.routing.weights.queue": "documented for the endpoint picker; the gateway takes weights from its flags",
    "spec.routing.weights.kvCache": "as spec.routing.weights.queue",
    "spec.routing.weights.loraAffinity": "as spec.routing.weights.queue",
    "spec.routing.weights.prefixCache": "as spec.routing.weights.queue",
}
# CRD field -> where the typed model holds it ("[]" walks a tuple).
ATTRIBUTES = {
    "spec.model.uri": "model", "spec.model.servedName": "served_name",
    "spec.engine.image": "engine.image", "spec.engine.args": "engine.args", "spec.engine.env": "engine.env",
    "spec.engine.resources.gpus": "engine.resources.gpus",
    "spec.engine.resources.gpuResourceName": "engine.resources.gpu_resource_name",
    "spec.engine.resources.cpu": "engine.resources.cpu", "spec.engine.resources.memory": "engine.resources.memory",
    "spec.engine.nodeSelector": "engine.node_selector", "spec.engine.tolerations": "engine.tolerations",
    "spec.engine.priorityClassName": "engine.priority_class_name", "spec.engine.maxModelLen": "engine.max_model_len",
    "spec.engine.dtype": "engine.dtype", "spec.engine.startupTimeoutSeconds": "engine.startup_timeout_seconds",
    "spec.engine.parallelism.tensor": "engine.parallelism.tensor",
    "spec.engine.parallelism.nodes": "engine.parallelism.nodes",
    "spec.replicas": "replicas", "spec.minReplicas": "min_replicas", "spec.maxReplicas": "max_replicas",
    "spec.standby.replicas": "standby",
    "spec.adapters[].name": "adapters[].name", "spec.adapters[].uri": "adapters[].source",
    "spec.adapterPool.maxLorasPerReplica": "adapter_pool.max_loras_per_replica",
    "spec.adapterPool.maxLoraRank": "adapter_pool.max_lora_rank",
    "spec.adapterPool.replicasPerAdapter": "adapter_pool.replicas_per_adapter",
    "spec.routing.priority": "routing.priority", "spec.routing.fallback": "routing.fallback",
    "spec.routing.kvEvents": "routing.kv_events",
    "spec.autoscaling.targetQueueDepth": "autoscaling.target_queue_depth",
    "spec.autoscaling.scaleDownDelaySeconds": "autoscaling.scale_down_delay_seconds",
}
PYTHON_TYPES = {"integer": int, "number": float, "string": str, "boolean": bool, "array": tuple, "object": dict}


class Recorded(dict):
    """A dict that records, in `seen`, the path of every key read from it and from the values it hands out."""

    def __init__(self, data: dict, path: str, seen: set[str]):
        super().__init__(data)
        self.path, self.seen = path, seen

    def get(self, key, default=None):
        self.seen.add(f"{self.path}.{key}")
        return _recorded(super().get(key, default), f"{self.path}.{key}", self.seen)

    def __getitem__(self, key):
        self.seen.add(f"{self.path}.{key}")
        return _recorded(super().__getitem__(key), f"{self.path}.{key}", self.seen)


def _recorded(value: Any, path: str, seen: set[str]) -> Any:
    if isinstance(value, dict):
        return Recorded(value, path, seen)
    if isinstance(value, list):
        return [_recorded(item, path + "[]", seen) for item in value]
    return value


def crd_fields(node: dict, path: str = "spec") -> dict[str, dict]:
    """CRD field path -> its schema, for every field under `path` that is not an object of named fields."""
    out = {}
    for name, child in (node.get("properties") or {}).items():
        where = f"{path}.{name}"
        if child.get("properties"):
            out.update(crd_fields(child, where))
        elif child.get("type") == "array" and (child.get("items") or {}).get("properties"):
            out.update(crd_fields(child["items"], where + "[]"))
        else:
            out[where] = child
    return out


FIELDS = crd_fields(SPEC)


def schema_at(path: str) -> dict | None:
    node = {"properties": {"spec": SPEC}}
    for part in path.split("."):
        node = (node.get("properties") or {}).get(part.removesuffix("[]"))
        if node is None:
            return None
        if part.endswith("[]"):
            node = node.get("items") or {}
    return node


def example(node: dict) -> Any:
    """A value for every field of a schema node, each within the CRD's bounds."""
    if node.get("properties"):
        return {name: example(child) for name, child in node["properties"].items()}
    if node.get("x-kubernetes-int-or-string"):
        return "1"
    if "enum" in node:
        return node["enum"][0]
    kind = node.get("type")
    if kind == "object":
        return {"key": example(node["additionalProperties"])} if "additionalProperties" in node else {"x": "y"}
    if kind == "array":
        return [example(node["items"])]
    if kind == "integer":
        return max(node.get("minimum", 1), 1)
    if kind == "number":
        return int(node.get("minimum", 0)) + 1  # JSON may carry a number as an integer: the reading converts
    if kind == "boolean":
        return True
    return "pvc://claim/dir" if node.get("pattern", "").startswith("^(pvc") else "a"


FULL = example(SPEC)


def attribute(model: InferenceModel, where: str) -> Any:
    values: list[Any] = [model]
    for part in where.split("."):
        values = [getattr(v, part.removesuffix("[]")) for v in values]
        if part.endswith("[]"):
            values = [item for v in values for item in v]
    return values[0] if "[]" not in where else tuple(values)


def changed(spec: dict, path: str, value: Any = None, remove: bool = False) -> dict:
    """`spec` (the value at CRD path "spec") with the field at `path` set to `value` or removed (in every item
    of an array)."""
    out = copy.deepcopy(spec)
    nodes = [out]
    parts = path.split(".")[1:]
    for part in parts[:-1]:
        nodes = [n[part.removesuffix("[]")] for n in nodes]
        if part.endswith("[]"):
            nodes = [item for n in nodes for item in n]
    for node in nodes:
        if remove:
            node.pop(parts[-1])
        else:
            node[parts[-1]] = value
    return out


def without(spec: dict, path: str) -> dict:
    return changed(spec, path, remove=True)


def read_paths() -> set[str]:
    seen: set[str] = set()
    read_spec("m", Recorded(FULL, "spec", seen))
    return seen


def test_the_full_example_reads_without_a_problem():
    model, problems = read_spec("m", FULL)
    assert problems == [] and model.adapters and model.autoscaling is not None


def test_every_field_the_model_reads_is_in_the_crd():
    assert sorted(p for p in read_paths() if schema_at(p) is None) == []


def test_every_crd_field_is_read_or_listed_as_unread():
    seen = read_paths()
    whole = {p for p in seen if not any(q.startswith((p + ".", p + "[]")) for q in seen)}  # kept whole

    def covered(path: str) -> bool:
        return path in seen or any(path.startswith((w + ".", w + "[]")) for w in whole)
    assert sorted(f for f in FIELDS if not covered(f) and f not in UNREAD) == [], "read it, or list it in UNREAD"
    assert sorted(f for f in UNREAD if f not in FIELDS or covered(f)) == [], "UNREAD lists only unread CRD fields"
    assert sorted(whole) == sorted(ATTRIBUTES), "ATTRIBUTES names where the model holds every field read"


@pytest.mark.parametrize("path", sorted(ATTRIBUTES))
def test_a_field_reads_as_its_crd_type(path):
    node = schema_at(path)
    value = attribute(read_spec("m", FULL)[0], ATTRIBUTES[path])
    values = value if "[]" in path else (value,)
    expected = str if node.get("x-kubernetes-int-or-string") else PYTHON_TYPES[node["type"]]
    assert values and all(isinstance(v, expected) and (expected is bool or not isinstance(v, bool))
                          for v in values), f"{path}: {value!r} is not {node.get('type')}"


@pytest.mark.parametrize("path", sorted(p for p in ATTRIBUTES if "default" in schema_at(p)))
def test_an_absent_field_reads_as_the_crd_default(path):
    model, _ = read_spec("m", without(FULL, path))
    assert attribute(model, ATTRIBUTES[path]) == schema_at(path)["default"]


def _required(path: str) -> bool:
    parent, _, name = path.rpartition(".")
    return name in (schema_at(parent) or {}).get("required", [])


@pytest.mark.parametrize("path", sorted(p for p in ATTRIBUTES if "default" not in schema_at(p)))
def test_an_absent_field_without_a_crd_default_is_unset_required_or_derived(path):
    model, problems = read_spec("m", without(FULL, path))
    if _required(path):
        assert any(path.replace("[]", "[0]") in p for p in problems), f"{path} is required: {problems}"
    elif path == "spec.model.servedName":
        assert model.served_name == "m"  # metadata.name
    elif path == "spec.engine.parallelism.tensor":
        two_gpus = without({**FULL, "engine": {**FULL["engine"], "resources": {"gpus": 2}}}, path)
        assert read_spec("m", two_gpus)[0].engine.parallelism.tensor == 2  # one rank per GPU of the pod
    else:
        assert attribute(model, ATTRIBUTES[path]) in (None, (), {}), path


@pytest.mark.parametrize("path", sorted(p for p in ATTRIBUTES if "enum" in schema_at(p)))
def test_an_enum_field_takes_exactly_the_crd_values(path):
    for value in schema_at(path)["enum"]:
        assert read_spec("m", changed(FULL, path, value))[1] == [], value
    assert read_spec("m", changed(FULL, path, "not-in-the-enum"))[1]


def test_the_enums_read_are_the_readings_own_tables():
    assert tuple(schema_at("spec.engine.dtype")["enum"]) == DTYPES


@pytest.mark.parametrize("reader", ["priorities_of", "scale_targets_of", "fallbacks_of", "served_name"])
def test_the_parts_read_an_inference_model_only_through_the_model(reader):
    """What the gateway's maps and the operator's served-name claim read of a whole object: its metadata and
    exactly the spec fields the typed model reads."""
    from kubeinfer.gateway.flowcontrol import fallback, model_priorities
    from kubeinfer.operator import served_names

    read = {"priorities_of": model_priorities.priorities_of, "scale_targets_of": model_priorities.scale_targets_of,
            "fallbacks_of": fallback.fallbacks_of, "served_name": served_names.served_name}[reader]
    seen: set[str] = set()
    obj = Recorded({"metadata": {"name": "m", "namespace": "ns"}, "spec": FULL}, "object", seen)
    read(obj) if reader == "served_name" else read([obj])
    spec_reads = {p.removeprefix("object.") for p in seen if p.startswith("object.spec.")}
    others = {p for p in seen if not p.startswith(("object.spec.", "object.metadata"))} - {"object.spec"}
    # The typed reading reads every field it knows; a raw dict reading would read a few, or others.
    assert spec_reads == read_paths() and not others, (spec_reads ^ read_paths(), others)
