"""The engine pod's volume plan as the kubelet and the runtime must carry it out (issue #46, defects 3-5).

3: a model and its adapters on one claim get one pod volume (two volumes of one claim never mount).
4: no mount sits inside a read-only mount (runc cannot create the mount point there: the pod never starts).
5: the fetch init containers go online (the engine image sets HF_HUB_OFFLINE=1) and print no colours.
"""
from __future__ import annotations

import posixpath
from collections import Counter

import kubernetes_validate
import pytest

from kubeinfer.operator.builders import desired_objects
from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.leader_worker import leader_worker_set
from kubeinfer.operator.names import ADAPTERS_DIR
from kubeinfer.operator.spec import parse_spec

K8S = kubernetes_validate.utils.latest_version()
OWNER = {"apiVersion": "serving.kubeinfer.io/v1alpha1", "kind": "InferenceModel",
         "metadata": {"name": "llama", "namespace": "ml", "uid": "6f1c2a4e-0000-4000-8000-000000000002"}}
SPECS = {
    "model-and-adapters-on-one-claim": {
        "model": {"uri": "pvc://store/base"},
        "adapters": [{"name": "legal", "uri": "pvc://store/adapters/legal"},
                     {"name": "sql", "uri": "pvc://store/adapters/sql"}]},
    "adapters-on-their-own-claim": {
        "model": {"uri": "pvc://store/base"}, "adapters": [{"name": "legal", "uri": "pvc://loras/legal"}]},
    "file-adapters": {
        "model": {"uri": "file:///srv/models/base"}, "adapters": [{"name": "legal", "uri": "file:///srv/loras/legal"}]},
    "every-source": {
        "model": {"uri": "hf://acme/base"},
        "adapters": [{"name": "sql", "uri": "hf://acme/sql-lora"}, {"name": "de", "uri": "s3://loras/de"},
                     {"name": "fr", "uri": "pvc://loras/fr"}, {"name": "es", "uri": "file:///srv/loras/es"}]},
}


def pod_spec(name: str | dict) -> dict:
    spec = parse_spec("llama", SPECS[name] if isinstance(name, str) else name)
    objects = {o["kind"]: o for o in desired_objects(OWNER, spec, OperatorConfig(), with_pool=False)}
    kubernetes_validate.validate(objects["Deployment"], K8S, strict=True)
    return objects["Deployment"]["spec"]["template"]["spec"]


def engine_mounts(pod: dict) -> list[dict]:
    return pod["containers"][0]["volumeMounts"]


def inside(path: str, parent: str) -> bool:
    return path != parent and path.startswith(parent.rstrip("/") + "/")


@pytest.mark.parametrize("name", SPECS)
def test_one_pod_volume_per_claim(name):
    pod = pod_spec(name)
    claims = Counter(v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v)
    assert all(n == 1 for n in claims.values()), claims
    names = [v["name"] for v in pod["volumes"]]
    assert len(names) == len(set(names))
    assert {m["name"] for m in engine_mounts(pod)} <= set(names)


def test_model_and_adapters_on_one_claim_share_its_volume_with_their_own_subpaths():
    pod = pod_spec("model-and-adapters-on-one-claim")
    by_path = {m["mountPath"]: m for m in engine_mounts(pod)}
    volume = by_path["/models/model"]["name"]
    assert by_path[f"{ADAPTERS_DIR}/legal"]["name"] == by_path[f"{ADAPTERS_DIR}/sql"]["name"] == volume
    assert [by_path[p]["subPath"] for p in ("/models/model", f"{ADAPTERS_DIR}/legal", f"{ADAPTERS_DIR}/sql")] == [
        "base", "adapters/legal", "adapters/sql"]


@pytest.mark.parametrize("name", SPECS)
def test_no_mount_is_nested_inside_a_read_only_mount(name):
    pod = pod_spec(name)
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        mounts = container["volumeMounts"]
        for mount in mounts:
            outer = [m["mountPath"] for m in mounts if m.get("readOnly") and inside(mount["mountPath"], m["mountPath"])]
            assert not outer, f"{container['name']}: {mount['mountPath']} inside read-only {outer}"


@pytest.mark.parametrize("name", SPECS)
def test_every_adapter_is_its_own_read_only_mount_in_the_catalog_dir(name):
    pod = pod_spec(name)
    by_path = {m["mountPath"]: m for m in engine_mounts(pod)}
    for adapter in SPECS[name]["adapters"]:
        assert by_path[posixpath.join(ADAPTERS_DIR, adapter["name"])]["readOnly"]


def test_a_fetched_adapter_is_mounted_from_where_its_fetch_writes_it():
    pod = pod_spec("every-source")
    volumes = {v["name"]: v for v in pod["volumes"]}
    init = {c["name"]: c for c in pod["initContainers"]}
    for container, adapter in (("fetch-adapter-0", "sql"), ("fetch-adapter-1", "de")):
        fetch = init[container]
        cache = next(m for m in fetch["volumeMounts"] if m["mountPath"] == ADAPTERS_DIR)
        assert not cache.get("readOnly") and "emptyDir" in volumes[cache["name"]]
        assert f"{ADAPTERS_DIR}/{adapter}" in fetch["command"]
        mount = next(m for m in engine_mounts(pod) if m["mountPath"] == f"{ADAPTERS_DIR}/{adapter}")
        assert (mount["name"], mount["subPath"]) == (cache["name"], adapter)


def test_multi_node_pods_keep_the_same_plan():
    spec = parse_spec("llama", {**SPECS["model-and-adapters-on-one-claim"],
                                "engine": {"parallelism": {"tensor": 1, "nodes": 2}}})
    lws = leader_worker_set(dict(OWNER["metadata"]), spec, OperatorConfig())
    template = lws["spec"]["leaderWorkerTemplate"]
    for pod in (template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]):
        claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert len(claims) == 1


def fetch_env(pod: dict, container: str) -> dict[str, str]:
    init = {c["name"]: c for c in pod["initContainers"]}
    names = [e["name"] for e in init[container]["env"]]
    assert len(names) == len(set(names)), names  # server-side apply refuses duplicate keys
    return {e["name"]: e.get("value") for e in init[container]["env"]}


@pytest.mark.parametrize("container", ["fetch-model", "fetch-adapter-0", "fetch-adapter-1"])
def test_fetch_containers_go_online_and_print_plain_text(container):
    env = fetch_env(pod_spec("every-source"), container)
    assert env["HF_HUB_OFFLINE"] == "0"  # the engine image's ENV says 1: only serving is offline
    assert env["NO_COLOR"] == "1" and env["TERM"] == "dumb"  # the log tail becomes the condition message
    engine_env = {e["name"]: e.get("value") for e in pod_spec("every-source")["containers"][0]["env"]}
    assert engine_env["HF_HUB_OFFLINE"] == "1"


def test_the_fetch_settings_win_over_spec_env_without_duplicates():
    spec = {**SPECS["every-source"], "engine": {"env": [{"name": "HF_HUB_OFFLINE", "value": "1"},
                                                       {"name": "HOME", "value": "/root"}]}}
    env = fetch_env(pod_spec(spec), "fetch-model")
    assert env["HF_HUB_OFFLINE"] == "0" and env["HOME"] == "/tmp"
