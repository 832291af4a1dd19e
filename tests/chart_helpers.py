"""Rendering the Helm chart and checking what it renders, shared by tests/chart/test_chart.py."""
from __future__ import annotations

import subprocess
from functools import lru_cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kubeinfer"
KUBE_VERSION = "1.37.0"  # the newest release kubernetes-validate bundles schemas for
NAMESPACE = "llm"

ALL_ON = {
    "imagePullSecrets": [{"name": "registry"}],
    "operator": {
        "image": {"digest": "sha256:" + "a" * 64},
        "watchNamespaces": ["team-a", "team-b"],
        "extraArgs": ["--verbose"],
        "env": [{"name": "HF_HUB_ENABLE_HF_TRANSFER", "value": "1"}],
        "podAnnotations": {"example.com/owner": "ml-platform"},
        "podLabels": {"team": "ml-platform"},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]}]}]}}},
        "priorityClassName": "system-cluster-critical",
    },
    "engine": {"image": {"repository": "registry.example.com/kubeinfer/engine", "tag": "0.1.0-cuda"}},
    "gateway": {
        "replicas": 2,
        "upstream": {"connectTimeoutSeconds": 2.5, "firstByteTimeoutSeconds": 900, "idleTimeoutSeconds": 60,
                     "maxAttempts": 2},
        "hold": {"maxPerModel": 32, "timeoutSeconds": 45},
        "image": {"tag": "0.1.0", "pullPolicy": "Always"},
        "watchNamespace": "team-a",
        "inferencePool": "chat",
        "extraArgs": ["--log-level=debug"],
        "prefixRouting": {"mode": "precise", "tokenizers": ["chat=chat"],
                          "tokenizerVolume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}},
        "service": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"}},
        "podAnnotations": {"example.com/owner": "ml-platform"},
        "nodeSelector": {"kubernetes.io/os": "linux"},
    },
    "monitoring": {
        "serviceMonitor": {"enabled": True, "interval": "30s", "scrapeTimeout": "10s",
                           "labels": {"release": "kube-prometheus-stack"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "dashboard": {"namespace": "monitoring", "annotations": {"grafana_folder": "LLM serving"}},
    },
}
VARIANTS = {
    "defaults": {},
    "all-on": ALL_ON,
    "gateway-cluster-wide": {"gateway": {"watchAllNamespaces": True}, "monitoring": {"serviceMonitor": {"enabled": True}}},
    "minimal": {"gateway": {"enabled": False}, "rbac": {"aggregateToDefaultRoles": False},
                "monitoring": {"dashboard": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
}


def run_helm(helm: Path, *args: str, values: dict | None = None, tmp_path: Path | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    command = [str(helm), *args]
    if values:
        values_file = tmp_path / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        command += ["-f", str(values_file)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={"HOME": str(tmp_path or ROOT / ".cache"), "PATH": "/usr/bin:/bin",
                                 "HELM_CACHE_HOME": str(ROOT / ".cache" / "helm")})
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(command)} failed:\n{result.stderr}")
    return result


def find(objects: list[dict], kind: str, name_suffix: str = "") -> list[dict]:
    return [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]


def one(objects: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = find(objects, kind, name_suffix)
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def _strict(schema):
    """Unknown fields are errors, as the API server's strict field validation makes them."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(item) for item in schema]
    return schema


@lru_cache(maxsize=None)
def prometheus_operator_validator(kind: str) -> jsonschema.Draft202012Validator:
    """The Prometheus Operator's schema for `kind`, from models generated from its CRDs (cloudcoil)."""
    from cloudcoil.models.prometheus_operator import v1

    schema = getattr(v1, kind).model_json_schema(by_alias=True, mode="validation")
    return jsonschema.Draft202012Validator(_strict(schema))


def validate(obj: dict) -> list[str]:
    if obj["apiVersion"].startswith("monitoring.coreos.com/"):
        errors = prometheus_operator_validator(obj["kind"]).iter_errors(obj)
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
    try:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{'.'.join(map(str, error.path))}: {error.message}"]
    return []


def granted(objects: list[dict], service_account: str) -> dict[str | None, set[tuple[str, str, str]]]:
    """(apiGroup, resource, verb) granted to a ServiceAccount: None -> cluster-wide, else per namespace."""
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
             for o in objects if o["kind"] in ("Role", "ClusterRole")}
    out: dict[str | None, set] = {}
    for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == service_account and s["namespace"] == NAMESPACE
                   for s in binding["subjects"]):
            continue
        ref = binding["roleRef"]
        scope = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        role = roles[(ref["kind"], scope if ref["kind"] == "Role" else None, ref["name"])]
        for rule in role["rules"]:
            assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"], "no wildcards"
            out.setdefault(scope, set()).update(
                (g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"])
    return out


def fake_layer_wheel(path: Path, helm_bytes: bytes) -> Path:
    """The layout of the kubectl-layer wheel: wheel -> jsii tarball -> layer.zip -> helm/helm."""
    import io
    import tarfile
    import zipfile

    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as z:
        z.writestr("helm/helm", helm_bytes)
    tarball = io.BytesIO()
    with tarfile.open(fileobj=tarball, mode="w:gz") as t:
        info = tarfile.TarInfo("package/lib/layer.zip")
        info.size = len(layer.getvalue())
        t.addfile(info, io.BytesIO(layer.getvalue()))
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("aws_cdk/layer/_jsii/layer@1.0.0.jsii.tgz", tarball.getvalue())
    return path
