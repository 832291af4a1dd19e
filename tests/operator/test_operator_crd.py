"""The InferenceModel CRD: accepted by Kubernetes' own schema, structural, its OpenAPI schema and CEL
rules accept good specs and refuse bad ones, and its defaults are the operator's."""
from __future__ import annotations

import copy
from pathlib import Path

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kubeinfer.operator.names import GROUP, KIND, PLURAL, VERSION
from kubeinfer.operator.spec import parse_spec

CRD_PATH = Path(__file__).parents[2] / "crds" / "inferencemodels.serving.kubeinfer.io.yaml"
CRD = yaml.safe_load(CRD_PATH.read_text())
VERSION_ENTRY = CRD["spec"]["versions"][0]
SCHEMA = VERSION_ENTRY["schema"]["openAPIV3Schema"]
K8S = kubernetes_validate.utils.latest_version()

CPU_MODEL = {"model": {"uri": "pvc://models/qwen2-0.5b"}}
GPU_MODEL = {
    "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct@main", "servedName": "llama-3.1-8b"},
    "engine": {"resources": {"gpus": 1, "cpu": "8", "memory": "48Gi"}, "dtype": "bfloat16", "maxModelLen": 8192,
               "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
               "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
               "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]},
    "replicas": 2, "minReplicas": 1, "maxReplicas": 6, "standby": {"replicas": 1},
    "adapters": [{"name": "sql", "uri": "s3://loras/sql"}, {"name": "chat-de", "uri": "pvc://loras/chat-de"}],
    "adapterPool": {"maxLorasPerReplica": 8, "replicasPerAdapter": 2},
    "routing": {"priority": 10, "weights": {"queue": 2, "kvCache": 1, "loraAffinity": 1, "prefixCache": 3},
                "kvEvents": True},
    "autoscaling": {"targetQueueDepth": 4, "scaleDownDelaySeconds": 600},
}


def full(spec: dict, name: str = "llama") -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": name}, "spec": spec}


def apply_defaults(schema: dict, value):
    """The API server's defaulting: a default fills a missing field whose parent object is present."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    for key, sub in (schema.get("properties") or {}).items():
        if key not in value and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])
        if key in value:
            if sub.get("type") == "array" and isinstance(value[key], list):
                value[key] = [apply_defaults(sub["items"], item) for item in value[key]]
            else:
                value[key] = apply_defaults(sub, value[key])
    return value


def schema_errors(obj: dict) -> list[str]:
    # OpenAPI v3.0 schemas use draft-4 keywords (boolean exclusiveMinimum); x-kubernetes-* are ignored.
    return [e.message for e in jsonschema.Draft4Validator(SCHEMA).iter_errors(obj)]


def rules(schema: dict, path: str = ""):
    """(path, rule, message) of every CEL rule in the schema."""
    for item in schema.get("x-kubernetes-validations") or []:
        yield path, item["rule"], item["message"]
    for key, sub in (schema.get("properties") or {}).items():
        yield from rules(sub, f"{path}.{key}")
    if "items" in schema:
        yield from rules(schema["items"], f"{path}[]")


def cel_ok(path: str, rule: str, obj: dict) -> bool:
    node = obj
    for part in [p for p in path.split(".") if p]:
        if part.endswith("[]"):
            raise NotImplementedError(path)
        if part not in node:
            return True  # rules only run on present fields
        node = node[part]
    env = celpy.Environment()
    return bool(env.program(env.compile(rule)).evaluate({"self": celpy.json_to_cel(node)}))


def cel_failures(obj: dict) -> list[str]:
    obj = apply_defaults(SCHEMA, copy.deepcopy(obj))
    return [message for path, rule, message in rules(SCHEMA) if not cel_ok(path, rule, obj)]


def test_crd_is_a_valid_kubernetes_object():
    kubernetes_validate.validate(CRD, K8S, strict=True)
    names = CRD["spec"]["names"]
    assert (CRD["spec"]["group"], VERSION_ENTRY["name"], names["plural"], names["kind"]) == (GROUP, VERSION,
                                                                                              PLURAL, KIND)
    assert names["shortNames"] == ["im"] and CRD["spec"]["scope"] == "Namespaced"
    assert CRD["metadata"]["name"] == f"{PLURAL}.{GROUP}"


def _walk(schema: dict, path: str):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")


def test_schema_is_structural():
    """Kubernetes' structural-schema rules: every node typed, no properties next to additionalProperties."""
    for path, node in _walk(SCHEMA, ""):
        assert "type" in node or node.get("x-kubernetes-int-or-string") or \
            node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        if "properties" in node:
            assert node["type"] == "object", path
        if node.get("x-kubernetes-list-type") == "map":
            assert all(k in node["items"].get("required", []) for k in node["x-kubernetes-list-map-keys"]), path


def test_subresources_and_columns_point_at_real_fields():
    scale = VERSION_ENTRY["subresources"]["scale"]
    assert scale == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                     "labelSelectorPath": ".status.selector"}
    props = SCHEMA["properties"]
    assert props["spec"]["properties"]["replicas"]["type"] == "integer"
    assert props["status"]["properties"]["replicas"]["type"] == "integer"
    assert props["status"]["properties"]["selector"]["type"] == "string"
    columns = {c["name"]: c["jsonPath"] for c in VERSION_ENTRY["additionalPrinterColumns"]}
    assert {"Model", "Replicas", "Ready", "Standby", "Adapters", "Age"} <= set(columns)
    for path in columns.values():
        head = path.split("[")[0].strip(".").split(".")
        node = SCHEMA
        for part in head:
            if part == "metadata":
                break
            node = node["properties"][part]
            node = node.get("items", node)


def test_every_field_is_described():
    """kubectl explain shows these: every spec field and its sub-fields say what they are for."""
    undescribed = [path for path, node in _walk(SCHEMA["properties"]["spec"], ".spec")
                   if "[]" not in path and "{}" not in path and not node.get("description")]
    assert undescribed == []


@pytest.mark.parametrize("spec", [CPU_MODEL, GPU_MODEL], ids=["cpu", "gpu"])
def test_examples_pass_schema_and_cel(spec):
    assert schema_errors(full(spec)) == []
    assert cel_failures(full(spec)) == []


@pytest.mark.parametrize("change, expected", [
    ({"model": {"uri": "https://example.com/model"}}, "does not match"),
    ({"model": {}}, "'uri' is a required property"),
    ({"replicas": -1}, "less than the minimum"),
    ({"engine": {"dtype": "int4"}}, "is not one of"),
    ({"adapters": [{"name": "SQL", "uri": "pvc://l/sql"}]}, "does not match"),
    ({"adapters": [{"name": "sql"}]}, "'uri' is a required property"),
    ({"autoscaling": {"targetQueueDepth": 0}, "maxReplicas": 3}, "less than or equal to the minimum"),
    ({"standby": {"replicas": -2}}, "less than the minimum"),
    ({"engine": {"resources": {"gpus": 1.5}}}, "is not of type 'integer'"),
    ({"routing": {"kvEvents": "yes"}}, "is not of type 'boolean'"),
])
def test_schema_refuses_bad_specs(change, expected):
    errors = schema_errors(full({**CPU_MODEL, **change}))
    assert any(expected in e for e in errors), errors


@pytest.mark.parametrize("spec, message", [
    ({**CPU_MODEL, "replicas": 5, "maxReplicas": 4}, "spec.replicas must be at most spec.maxReplicas"),
    ({**CPU_MODEL, "replicas": 1, "minReplicas": 2}, "spec.replicas must be at least spec.minReplicas"),
    ({**CPU_MODEL, "replicas": 3, "minReplicas": 3, "maxReplicas": 2}, "spec.minReplicas must be at most"),
    ({**CPU_MODEL, "autoscaling": {"targetQueueDepth": 4}}, "spec.autoscaling needs spec.maxReplicas"),
    ({**CPU_MODEL, "adapters": [{"name": "a", "uri": "pvc://l/a"}, {"name": "a", "uri": "pvc://l/b"}]},
     "spec.adapters names must be unique"),
])
def test_cel_rules_refuse_bad_specs(spec, message):
    failures = cel_failures(full(spec))
    assert any(f.startswith(message) for f in failures), failures


@pytest.mark.parametrize("name, ok", [("llama", True), ("llama-3-8b", True), ("Llama", False), ("3llama", False),
                                      ("a" * 63, True), ("a" * 64, False), ("llama.v1", False)])
def test_cel_name_rule_matches_what_the_service_needs(name, ok):
    assert (cel_failures(full(CPU_MODEL, name)) == []) == ok
    with_error = not ok
    try:
        parse_spec(name, CPU_MODEL)
        refused = False
    except ValueError:
        refused = True
    assert refused == with_error  # the operator refuses exactly what the CEL rule refuses


def test_every_rule_compiles_in_cel():
    env = celpy.Environment()
    found = list(rules(SCHEMA))
    assert len(found) >= 6
    for _, rule, _ in found:
        env.compile(rule)


def test_crd_defaults_are_the_operators_defaults():
    """parse_spec of a bare spec equals parse_spec of the same spec defaulted by the API server."""
    for spec in (CPU_MODEL, GPU_MODEL):
        defaulted = apply_defaults(SCHEMA, full(copy.deepcopy(spec)))["spec"]
        assert defaulted != spec  # defaults did apply
        assert parse_spec("llama", defaulted) == parse_spec("llama", spec)


def test_status_written_by_the_operator_fits_the_status_schema():
    from kubeinfer.operator.placement import place_adapters
    from kubeinfer.operator.pods import PodView
    from kubeinfer.operator.roles import assign_roles
    from kubeinfer.operator.status import build_status, invalid_status

    spec = parse_spec("llama", GPU_MODEL)
    pods = [PodView("p0", "active", True), PodView("p1", None, False, unschedulable="0/3 nodes: Insufficient "
                                                                                   "nvidia.com/gpu")]
    plan = assign_roles(pods, spec.replicas)
    placement = place_adapters(["sql", "chat-de"], plan.active(), {}, 2, 8)
    body = {"metadata": {"name": "llama", "namespace": "ml", "generation": 3}}
    status = build_status(body, spec, pods, plan, placement, "2026-01-01T00:00:00Z")
    assert schema_errors({**full(GPU_MODEL), "status": status}) == []
    bad = invalid_status("spec.model.uri: nope", [], 3, "2026-01-01T00:00:00Z")
    assert schema_errors({**full(GPU_MODEL), "status": bad}) == []
