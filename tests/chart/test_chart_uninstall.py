"""What `helm uninstall` leaves (issue #46, defect 10): the InferenceModels and their pods outlive the release
(docs/deploy.md), so the engine key Secrets they read at every start are kept too; a user's own Secret is
never the chart's."""
from __future__ import annotations

import pytest
import yaml
from chart_helpers import CHART, KUBE_VERSION, NAMESPACE, find, run_helm

from kubeinfer.operator.pod_template import api_key_env

KEEP = {"helm.sh/resource-policy": "keep"}


@pytest.fixture(scope="module")
def render(tmp_path_factory):
    from repo_tools import load_tool

    helm = load_tool("fetch_helm").ensure_helm()

    def rendered(values: dict) -> list[dict]:
        result = run_helm(helm, "template", "kubeinfer", str(CHART), "--namespace", NAMESPACE, "--kube-version",
                          KUBE_VERSION, values=values, tmp_path=tmp_path_factory.mktemp("uninstall"))
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return rendered


def test_the_engine_key_secrets_survive_helm_uninstall(render):
    objects = render({"operator": {"watchNamespaces": ["team-a", "team-b"]}})
    secrets = find(objects, "Secret", "-engine-api-key")
    assert sorted(s["metadata"]["namespace"] for s in secrets) == [NAMESPACE, "team-a", "team-b"]
    for secret in secrets:  # an engine pod that restarts after the uninstall still finds its key
        assert secret["metadata"].get("annotations", {}).items() >= KEEP.items(), secret["metadata"]
        assert secret["metadata"]["labels"]["app.kubernetes.io/component"] == "engine-api-key"  # the docs' cleanup


def test_only_the_key_is_kept(render):
    kept = [o for o in render({}) if (o["metadata"].get("annotations") or {}).get("helm.sh/resource-policy")]
    assert {o["kind"] for o in kept} == {"Secret"}


def test_the_engines_read_the_kept_secret():
    from kubeinfer.operator.config import OperatorConfig

    env, = api_key_env(OperatorConfig(engine_api_key_secret="kubeinfer-kubeinfer-engine-api-key"))
    assert env["valueFrom"]["secretKeyRef"]["name"] == "kubeinfer-kubeinfer-engine-api-key"


def test_the_docs_say_what_uninstall_keeps():
    text = (CHART.parent.parent / "docs" / "deploy.md").read_text()
    section = text[text.index("## Upgrade and uninstall"):]
    assert "resource-policy: keep" in section and "engine-api-key" in section
