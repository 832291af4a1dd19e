"""The chart's tenants and fallback values: the tenants file mounted from a Secret (a directory mount,
so Secret updates reach the gateway) and flags the gateway CLI accepts."""
from __future__ import annotations

import pytest
import yaml
from chart_helpers import CHART, KUBE_VERSION, NAMESPACE, container, one, run_helm, validate
from repo_tools import load_tool


@pytest.fixture(scope="module")
def helm():
    return load_tool("fetch_helm").ensure_helm()


def render(helm, tmp_path, values: dict) -> list[dict]:
    result = run_helm(helm, "template", "kubeinfer", str(CHART), "--namespace", NAMESPACE, "--kube-version",
                      KUBE_VERSION, values=values, tmp_path=tmp_path)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_the_tenants_secret_is_mounted_and_passed_with_the_limit_scope(helm, tmp_path):
    import argparse

    from kubeinfer.gateway.cli import add_arguments

    objects = render(helm, tmp_path, {"gateway": {
        "replicas": 3, "fallback": ["big=small"],
        "tenants": {"existingSecret": "gateway-tenants", "limitScope": "divided", "trustTenantHeader": True}}})
    deployment = one(objects, "Deployment", "-gateway")
    assert validate(deployment) == []
    gateway = container(deployment)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(gateway["args"][1:])
    assert (args.tenants, args.tenant_limit_scope, args.gateway_replicas, args.trust_tenant_header, args.fallback) == (
        "/etc/kubeinfer/tenants/tenants.yaml", "divided", 3, True, [("big", "small")])
    mount = next(m for m in gateway["volumeMounts"] if m["name"] == "tenants")
    assert mount == {"name": "tenants", "mountPath": "/etc/kubeinfer/tenants", "readOnly": True}  # no subPath
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "tenants")
    assert volume["secret"]["secretName"] == "gateway-tenants"


def test_without_a_tenants_secret_nothing_is_mounted(helm, tmp_path):
    gateway = container(one(render(helm, tmp_path, {}), "Deployment", "-gateway"))
    assert not any(a.startswith("--tenants") for a in gateway["args"])
    assert [m["name"] for m in gateway["volumeMounts"]] == ["tmp"]
