"""Every uid and gid a pod runs with has a user and a group in the image it runs (issue #46: the chart runs the
operator as 65532, the image had only user 1000, and kopf's getpass.getuser() died with "getpwuid(): uid not
found"). The uids come from what the chart renders (each variant) and from the operator's engine pods
(pod_template.POD_SECURITY); the users and groups from the final stage of each docker/*.Dockerfile."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from chart_helpers import ROOT
from test_chart import helm, rendered  # noqa: F401 - the session's helm binary and rendered variants

from kubeinfer.operator.pod_template import CONTAINER_SECURITY, POD_SECURITY

DOCKER = ROOT / "docker"
IMAGE_DOCKERFILES = {"gateway": ["gateway.Dockerfile"], "operator": ["operator.Dockerfile"],
                     "engine": ["engine-cpu.Dockerfile", "engine-gpu.Dockerfile"]}


def final_stage_accounts(dockerfile: Path) -> tuple[set[int], set[int]]:
    """(uids of the users, gids of the groups) the image's last stage creates with useradd / groupadd."""
    stage = re.split(r"^FROM\s", dockerfile.read_text(), flags=re.MULTILINE)[-1]
    commands = re.split(r"&&|;|\n(?!\s)", stage.replace("\\\n", " "))
    users = {int(m) for c in commands if "useradd" in c for m in re.findall(r"--uid[ =](\d+)", c)}
    groups = {int(m) for c in commands if "groupadd" in c for m in re.findall(r"--gid[ =](\d+)", c)}
    return users, groups


def pod_specs(obj: dict):
    """The pod specs of a workload object (Deployment, Job, CronJob, ...)."""
    spec = obj.get("spec") or {}
    if "template" in spec:
        yield spec["template"]["spec"]
    if "jobTemplate" in spec:
        yield spec["jobTemplate"]["spec"]["template"]["spec"]


def identities(pod: dict) -> list[tuple[str, dict]]:
    """(image, {runAsUser, runAsGroup, fsGroup}) of each container: the container's settings over the pod's."""
    base = {k: v for k, v in (pod.get("securityContext") or {}).items() if k in ("runAsUser", "runAsGroup", "fsGroup")}
    out = []
    for c in [*pod.get("initContainers", []), *pod.get("containers", [])]:
        own = {k: v for k, v in (c.get("securityContext") or {}).items() if k in ("runAsUser", "runAsGroup")}
        out.append((c["image"], {**base, **own}))
    return out


def missing_accounts(image_kind: str, ids: dict) -> list[str]:
    problems = []
    for dockerfile in IMAGE_DOCKERFILES[image_kind]:
        users, groups = final_stage_accounts(DOCKER / dockerfile)
        if "runAsUser" in ids and ids["runAsUser"] not in users:
            problems.append(f"{dockerfile}: no user with uid {ids['runAsUser']}")
        for key in ("runAsGroup", "fsGroup"):
            if key in ids and ids[key] not in groups:
                problems.append(f"{dockerfile}: no group with gid {ids[key]} ({key})")
    return problems


def image_kind(image: str) -> str:
    return image.rsplit("/", 1)[-1].split("@")[0].split(":")[0]


def test_the_chart_runs_only_uids_its_images_have(rendered):  # noqa: F811
    seen, problems = set(), []
    for variant, objects in rendered.items():
        for obj in objects:
            for pod in pod_specs(obj):
                for image, ids in identities(pod):
                    kind = image_kind(image)
                    assert kind in IMAGE_DOCKERFILES, f"{variant}: {obj['kind']} runs {image}, not built here"
                    seen.add(kind)
                    problems += missing_accounts(kind, ids)
    assert seen >= {"gateway", "operator"}
    assert sorted(set(problems)) == []


def test_the_engine_pods_run_uids_the_engine_images_have():
    ids = {**POD_SECURITY, **{k: v for k, v in CONTAINER_SECURITY.items() if k.startswith("runAs")}}
    assert missing_accounts("engine", ids) == []


def test_a_dockerfile_without_the_user_is_caught(tmp_path, monkeypatch):
    (tmp_path / "operator.Dockerfile").write_text(
        "FROM python:3.11.11-slim-bookworm AS build\nRUN useradd --uid 65532 x\n"
        "FROM python:3.11.11-slim-bookworm\nRUN groupadd --gid 1000 kubeinfer \\\n"
        "    && useradd --uid 1000 --gid 1000 kubeinfer\nUSER 1000:1000\n")
    monkeypatch.setitem(globals(), "DOCKER", tmp_path)
    assert final_stage_accounts(tmp_path / "operator.Dockerfile") == ({1000}, {1000})
    assert missing_accounts("operator", {"runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532}) == [
        "operator.Dockerfile: no user with uid 65532", "operator.Dockerfile: no group with gid 65532 (runAsGroup)",
        "operator.Dockerfile: no group with gid 65532 (fsGroup)"]


@pytest.mark.parametrize("dockerfile", sorted(DOCKER.glob("*.Dockerfile")), ids=lambda p: p.name)
def test_each_image_has_its_default_user(dockerfile):
    """The USER an image starts as exists in it."""
    users, _ = final_stage_accounts(dockerfile)
    user = re.findall(r"^USER\s+(\d+)", dockerfile.read_text(), re.MULTILINE)[-1]
    assert int(user) in users
