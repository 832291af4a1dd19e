"""Fixtures of the end-to-end suite (`make e2e`): a cluster from $KUBECONFIG, the images built and loaded, the chart
installed as the README says, tiny models on hostPath volumes. Every test here is marked `e2e` and skips, with the
reason, unless the run selects that marker (`-m e2e`) and a cluster answers; the transcript of timed steps is
printed at the end of the run."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_cluster import NAMESPACE, RELEASE, ROOT, TRANSCRIPT, PortForward, helm, kubectl, run, tool

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    selected = "e2e" in (config.option.markexpr or "") and "not e2e" not in (config.option.markexpr or "")
    for item in items:
        if Path(str(item.fspath)).parent == HERE:
            item.add_marker(pytest.mark.e2e)
            if not selected:
                item.add_marker(pytest.mark.skip(reason="end-to-end test: runs with `make e2e` (pytest -m e2e)"))


def pytest_terminal_summary(terminalreporter):
    if TRANSCRIPT.rows:
        terminalreporter.write_sep("=", "e2e transcript")
        terminalreporter.write_line(TRANSCRIPT.render())


def _cluster_problem() -> str | None:
    if not os.environ.get("KUBECONFIG"):
        return ("no cluster: KUBECONFIG is unset (on this machine: /work/shared/k8s-node/up.sh, then "
                ". /work/shared/k8s-node/env.sh)")
    if tool("kubectl") is None:
        return "no kubectl on PATH"
    try:
        nodes = kubectl("get", "nodes", "-o", "name", namespace=None, timeout=20, check=False)
    except subprocess.TimeoutExpired:
        return f"the cluster of KUBECONFIG={os.environ['KUBECONFIG']} does not answer in 20 s"
    if nodes.returncode != 0 or not nodes.stdout.strip():
        return f"the cluster of KUBECONFIG={os.environ['KUBECONFIG']} has no node: {nodes.stderr.strip()[:300]}"
    return None


@pytest.fixture(scope="session")
def cluster() -> None:
    problem = _cluster_problem()
    if problem:
        pytest.skip(problem)
    if tool("helm") is None:
        with TRANSCRIPT.step("fetch helm (tools/fetch_helm.py)"):
            run([sys.executable, str(ROOT / "tools" / "fetch_helm.py")], timeout=300)


def image_settings() -> dict[str, str]:
    registry = os.environ.get("E2E_REGISTRY", "localhost/kubeinfer")
    tag = os.environ.get("E2E_TAG", "e2e")
    return {"registry": registry, "tag": tag,
            "names": f"{registry}/engine:{tag}-cpu {registry}/gateway:{tag} {registry}/operator:{tag}"}


@pytest.fixture(scope="session")
def images(cluster) -> dict[str, str]:
    settings = image_settings()
    if os.environ.get("E2E_SKIP_BUILD") == "1":
        TRANSCRIPT.add("make images", 0.0, "skipped: E2E_SKIP_BUILD=1")
        return settings
    engine = os.environ.get("E2E_CONTAINER_ENGINE") or os.environ.get("K8S_NODE_ENGINE")
    if not engine:
        pytest.skip("no E2E_CONTAINER_ENGINE (nor the kit's K8S_NODE_ENGINE) to build the images with")
    with TRANSCRIPT.step("make images (engine-cpu gateway operator)"):
        run(["make", "-C", str(ROOT), "--no-print-directory", "images", f"CONTAINER_ENGINE={engine}",
             f"REGISTRY={settings['registry']}", f"TAG={settings['tag']}", "IMAGES=engine-cpu gateway operator"],
            timeout=3600)
    load = os.environ.get("E2E_LOAD_IMAGES")
    if load:
        with TRANSCRIPT.step("load images (E2E_LOAD_IMAGES)"):
            run([*shlex.split(load), *settings["names"].split()], timeout=1200)
    return settings


@pytest.fixture(scope="session")
def node_dir(cluster) -> Path:
    default = Path(os.environ.get("K8S_NODE_DIR", "/var/tmp/k8s-node")) / "e2e-data"
    path = Path(os.environ.get("E2E_NODE_DIR", str(default)))
    path.mkdir(parents=True, exist_ok=True)
    return path


def install_args(settings: dict[str, str], node_dir: Path) -> list[str]:
    """The README's `helm install`, plus the node directory `file://` adapters may mount."""
    return ["--namespace", NAMESPACE, "--set", f"imageRegistry={settings['registry']}",
            "--set", f"imageTag={settings['tag']}", "--set", f"engine.image.tag={settings['tag']}-cpu",
            "--set-json", f'operator.policy.hostPathPrefixes=["{node_dir / "host"}"]']


def _remove_release() -> None:
    """A previous run's release and models: models first (their finalizers need the operator), then the chart."""
    if kubectl("get", "namespace", NAMESPACE, namespace=None, check=False).returncode != 0:
        return
    kubectl("delete", "inferencemodels", "--all", "--wait=false", check=False)
    for im in kubectl("get", "inferencemodels", "-o", "name", check=False).stdout.split():
        kubectl("patch", im, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)
    run([tool("helm") or "helm", "uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "120s"],
        timeout=180, check=False)
    kubectl("delete", "namespace", NAMESPACE, "--timeout=180s", namespace=None, timeout=200, check=False)


@pytest.fixture(scope="session")
def release(images, node_dir):
    with TRANSCRIPT.step("remove a previous run's release"):
        _remove_release()
    with TRANSCRIPT.step("helm install (README's command)"):
        helm("install", RELEASE, str(ROOT / "charts" / "kubeinfer"), "--create-namespace",
             *install_args(images, node_dir))
    yield install_args(images, node_dir)
    if os.environ.get("E2E_KEEP") == "1":
        TRANSCRIPT.add("cleanup", 0.0, "skipped: E2E_KEEP=1")
        return
    with TRANSCRIPT.step("cleanup (models, release, namespace)"):
        _remove_release()
        for pv in ("kubeinfer-e2e-models", "kubeinfer-e2e-adapters"):
            kubectl("delete", "pv", pv, "--wait=false", namespace=None, check=False)


@pytest.fixture(scope="session")
def gateway(release):
    forward = PortForward("service/kubeinfer-gateway", 8080)
    yield forward
    forward.stop()
