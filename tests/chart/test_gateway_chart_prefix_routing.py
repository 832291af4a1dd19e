"""The chart's gateway.prefixRouting: --prefix-routing and --tokenizer flags the gateway CLI accepts, the tokenizer
volume mounted read-only, and precise mode without a tokenizer refused at `helm template`."""
from __future__ import annotations

import argparse

import pytest
import yaml
from chart_helpers import CHART, KUBE_VERSION, NAMESPACE, container, one, run_helm, validate
from repo_tools import load_tool

from kubeinfer.gateway.cli import add_arguments

MOUNT = "/etc/kubeinfer/tokenizers"
PVC = {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}


@pytest.fixture(scope="module")
def helm():
    return load_tool("fetch_helm").ensure_helm()


def render(helm, tmp_path, values: dict, check: bool = True):
    return run_helm(helm, "template", "kubeinfer", str(CHART), "--namespace", NAMESPACE, "--kube-version",
                    KUBE_VERSION, values=values, tmp_path=tmp_path, check=check)


def gateway_deployment(helm, tmp_path, values: dict) -> dict:
    return one([doc for doc in yaml.safe_load_all(render(helm, tmp_path, values).stdout) if doc], "Deployment",
               "-gateway")


def gateway_args(deployment: dict) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(container(deployment)["args"][1:])


def test_precise_routing_passes_the_tokenizers_and_mounts_their_volume_read_only(helm, tmp_path):
    deployment = gateway_deployment(helm, tmp_path, {"gateway": {"prefixRouting": {
        "mode": "precise", "tokenizers": ["chat=llama-3.1-8b", "/opt/tokenizers/default"], "tokenizerVolume": PVC}}})
    assert validate(deployment) == []
    args = gateway_args(deployment)
    assert args.prefix_routing == "precise"
    assert args.tokenizer == [f"chat={MOUNT}/llama-3.1-8b", "/opt/tokenizers/default"]
    mount = next(m for m in container(deployment)["volumeMounts"] if m["name"] == "tokenizers")
    assert mount == {"name": "tokenizers", "mountPath": MOUNT, "readOnly": True}
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "tokenizers")
    assert volume == {"name": "tokenizers", **PVC}


def test_defaults_route_approximately_with_nothing_mounted(helm, tmp_path):
    deployment = gateway_deployment(helm, tmp_path, {})
    gateway = container(deployment)
    assert "--prefix-routing=approximate" in gateway["args"]
    assert not any(a.startswith("--tokenizer") for a in gateway["args"])
    assert gateway_args(deployment).tokenizer == []
    assert [m["name"] for m in gateway["volumeMounts"]] == ["tmp"]


def test_precise_without_tokenizers_fails_with_its_reason(helm, tmp_path):
    result = render(helm, tmp_path, {"gateway": {"prefixRouting": {"mode": "precise", "tokenizerVolume": PVC}}},
                    check=False)
    assert result.returncode != 0
    assert "gateway.prefixRouting.mode precise needs gateway.prefixRouting.tokenizers" in result.stderr


@pytest.mark.parametrize("bad, complaint", [
    ({"mode": "exact"}, "/gateway/prefixRouting/mode"),
    ({"tokenizers": ["a=b=c"]}, "/gateway/prefixRouting/tokenizers/0"),
])
def test_values_schema_refuses_bad_prefix_routing(helm, tmp_path, bad, complaint):
    result = render(helm, tmp_path, {"gateway": {"prefixRouting": bad}}, check=False)
    assert result.returncode != 0 and "values don't meet the specifications of the schema" in result.stderr
    assert complaint in result.stderr
