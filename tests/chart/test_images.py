"""`make images` / `make push` and the chart's image values. No container engine runs here: a stand-in
`docker` (or `podman`) on PATH records what make asks of it, and the chart is rendered by helm."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from chart_helpers import CHART, KUBE_VERSION, NAMESPACE, ROOT, container, one, run_helm
from test_chart import helm  # noqa: F401 - the session's helm binary

DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))


def fake_engine(bin_dir: Path, name: str) -> Path:
    """A `docker`/`podman` that appends its arguments, one call per line, to calls.log."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = bin_dir / "calls.log"
    script = bin_dir / name
    script.write_text(f'#!/bin/sh\necho "$0 $*" >> {log}\n')
    script.chmod(0o755)
    return log


def make(*args: str, path: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path}
    env.pop("CONTAINER_ENGINE", None)
    return subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), *args], capture_output=True, text=True,
                          env=env, timeout=60, check=False)


def system_path() -> str:
    """PATH without any docker or podman this machine may have (the tests must not build for real)."""
    return ":".join(p for p in ("/usr/local/sbin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
                    if not any((Path(p) / n).exists() for n in ("docker", "podman")))


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_make_images_builds_each_image_with_the_engine_present(tmp_path, engine):
    log = fake_engine(tmp_path / "bin", engine)
    result = make("images", "REGISTRY=localhost:5000/team", "TAG=dev", path=f"{tmp_path / 'bin'}:{system_path()}")
    assert result.returncode == 0, result.stderr
    builds = [line.split()[1:] for line in log.read_text().splitlines()]
    assert [b[0] for b in builds] == ["build"] * 4 and all(b[-1] == "." for b in builds)
    tagged = {b[b.index("-f") + 1]: b[b.index("-t") + 1] for b in builds}
    assert tagged == {"docker/engine-cpu.Dockerfile": "localhost:5000/team/engine:dev-cpu",
                      "docker/engine-gpu.Dockerfile": "localhost:5000/team/engine:dev",
                      "docker/gateway.Dockerfile": "localhost:5000/team/gateway:dev",
                      "docker/operator.Dockerfile": "localhost:5000/team/operator:dev"}
    assert all((ROOT / dockerfile).is_file() for dockerfile in tagged)


def test_make_push_pushes_what_it_built_and_images_takes_a_subset(tmp_path):
    log = fake_engine(tmp_path / "bin", "docker")
    result = make("push", "IMAGES=engine-cpu gateway", "TAG=t1", path=f"{tmp_path / 'bin'}:{system_path()}")
    assert result.returncode == 0, result.stderr
    calls = [line.split()[1:] for line in log.read_text().splitlines()]
    assert [c[0] for c in calls] == ["build", "build", "push", "push"]
    assert [c[1] for c in calls[2:]] == ["ghcr.io/kubeinfer/engine:t1-cpu", "ghcr.io/kubeinfer/gateway:t1"]
    wrong = make("images", "IMAGES=engine-tpu", path=f"{tmp_path / 'bin'}:{system_path()}")
    assert wrong.returncode != 0 and "unknown image(s) engine-tpu" in wrong.stderr


def test_make_images_without_a_container_engine_says_so():
    result = make("images", path=system_path())
    assert result.returncode != 0
    assert "neither docker nor podman is installed" in result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_keep_pinned_bases(dockerfile):
    """Every base image names an exact version (no `latest`, no bare major): rebuilds stay reproducible."""
    bases = re.findall(r"^FROM\s+(\S+)", dockerfile.read_text(), re.MULTILINE)
    assert bases
    for base in bases:
        tag = base.partition(":")[2]
        assert tag and tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), f"{dockerfile.name}: {base}"


def test_the_chart_takes_the_registry_and_tag_in_one_place(helm, tmp_path):  # noqa: F811
    from test_chart import parse_operator_args

    from kubeinfer.operator.cli import config_from

    values = {"imageRegistry": "localhost:5000/team", "imageTag": "dev", "engine": {"image": {"tag": "dev-cpu"}}}
    result = run_helm(helm, "template", "kubeinfer", str(CHART), "--namespace", NAMESPACE, "--kube-version",
                      KUBE_VERSION, values=values, tmp_path=tmp_path)
    objects = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert container(one(objects, "Deployment", "-operator"))["image"] == "localhost:5000/team/operator:dev"
    assert container(one(objects, "Deployment", "-gateway"))["image"] == "localhost:5000/team/gateway:dev"
    operator = config_from(parse_operator_args(one(objects, "Deployment", "-operator")))
    assert operator.engine_image == "localhost:5000/team/engine:dev-cpu"
    # A repository with a "/" is a full name: the registry does not prefix it.
    (tmp_path / "full").mkdir()
    (tmp_path / "bad").mkdir()
    full = {"imageRegistry": "localhost:5000/team", "gateway": {"image": {"repository": "quay.io/me/gw"}}}
    result = run_helm(helm, "template", "kubeinfer", str(CHART), "--namespace", NAMESPACE, "--kube-version",
                      KUBE_VERSION, values=full, tmp_path=tmp_path / "full")
    objects = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert container(one(objects, "Deployment", "-gateway"))["image"] == "quay.io/me/gw:0.1.0"
    bad = run_helm(helm, "template", "kubeinfer", str(CHART), values={"imageRegistry": "has space/x"},
                   tmp_path=tmp_path / "bad", check=False)
    assert bad.returncode != 0 and "imageRegistry" in bad.stderr


def test_make_images_takes_any_docker_style_engine_and_the_torch_index(tmp_path):
    """CONTAINER_ENGINE=buildah (or the k8s-node kit's buildah-k8s-node); TORCH_INDEX reaches the engine images'
    builds only, as the build argument each engine Dockerfile declares."""
    log = fake_engine(tmp_path / "bin", "buildah")
    result = make("images", f"CONTAINER_ENGINE={tmp_path / 'bin' / 'buildah'}", "TAG=t2", "IMAGES=engine-cpu gateway",
                  "TORCH_INDEX=https://mirror.example/whl/cpu", path=system_path())
    assert result.returncode == 0, result.stderr
    builds = {b[b.index("-f") + 1]: b for b in (line.split()[1:] for line in log.read_text().splitlines())}
    engine, gateway = builds["docker/engine-cpu.Dockerfile"], builds["docker/gateway.Dockerfile"]
    assert engine[engine.index("--build-arg") + 1] == "TORCH_INDEX=https://mirror.example/whl/cpu"
    assert "--build-arg" not in gateway and engine[-1] == gateway[-1] == "."
    for name in ("engine-cpu", "engine-gpu"):
        text = (ROOT / "docker" / f"{name}.Dockerfile").read_text()
        assert re.search(r"^ARG TORCH_INDEX=\S+", text, re.MULTILINE) and '--index-url "${TORCH_INDEX}"' in text
