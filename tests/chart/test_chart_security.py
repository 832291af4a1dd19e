"""Issue 34 in the chart: the engines' API key (a Secret in every engine namespace, given to the gateway, the
operator and, through the operator's pod template, the engines), the operator's policy and NetworkPolicy
flags read back by the operator's own CLI, and the admission policy on the operator's pod patches, its CEL
evaluated by a CEL implementation (cel-python) on the patches the operator makes and on ones it must not."""
from __future__ import annotations

import argparse
import base64
import copy

import celpy
import kubernetes_validate
import pytest
import yaml
from chart_helpers import CHART, KUBE_VERSION, NAMESPACE, container, find, one, run_helm, validate
from operator_harness import Emulator

from kubeinfer.operator import names
from kubeinfer.operator.builders import network_policy
from kubeinfer.operator.cli import add_arguments, config_from
from kubeinfer.operator.pod_template import pod_template
from kubeinfer.operator.policy import PodPolicy
from kubeinfer.operator.spec import parse_spec

VARIANTS = {
    "defaults": {},
    "namespaced": {"operator": {"watchNamespaces": ["team-a", "team-b"]}, "gateway": {"watchNamespace": "team-a"}},
    "existing-key": {"engineApiKey": {"existingSecret": "my-engine-key", "key": "token"}},
    "open": {"engineApiKey": {"enabled": False}, "networkPolicy": {"enabled": False},
             "rbac": {"aggregateToDefaultRoles": False, "restrictOperatorPodPatches": False}},
    "policy": {"operator": {"policy": {
        "hostPathPrefixes": ["/srv/models"], "allowedImagePrefixes": ["registry.corp/ml/"],
        "allowedPriorityClasses": ["inference"], "allowWildcardTolerations": True, "allowControlPlane": True}},
        "networkPolicy": {"extraApiPeers": [{"namespaceSelector": {"matchLabels": {"gateway": "envoy"}}}],
                          "extraKvEventsPeers": [{"namespaceSelector": {"matchLabels": {"indexer": "llm-d"}}}],
                          "metricsPeers": [{"namespaceSelector": {"matchLabels": {
                              "kubernetes.io/metadata.name": "monitoring"}}}]}},
}


@pytest.fixture(scope="module")
def helm() -> object:
    from repo_tools import load_tool

    return load_tool("fetch_helm").ensure_helm()


@pytest.fixture(scope="module")
def rendered(helm, tmp_path_factory) -> dict[str, list[dict]]:
    out = {}
    for name, values in VARIANTS.items():
        result = run_helm(helm, "template", "kubeinfer", str(CHART), "--namespace", NAMESPACE,
                          "--kube-version", KUBE_VERSION, values=values, tmp_path=tmp_path_factory.mktemp(name))
        out[name] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_security_variant_validates_strictly(rendered, variant):
    for obj in rendered[variant]:
        assert validate(obj) == [], f"{obj['kind']} {obj['metadata']['name']}"


def operator_config(objects: list[dict]):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    args = container(one(objects, "Deployment", "-operator"))["args"]
    return config_from(parser.parse_args(args[1:]))


def env_ref(deployment: dict, name: str) -> dict | None:
    found = [e for e in container(deployment).get("env", []) if e["name"] == name]
    return found[0]["valueFrom"]["secretKeyRef"] if found else None


# -- the engines' API key ------------------------------------------------------------------------------------
def test_one_random_key_is_copied_into_every_engine_namespace(rendered):
    secrets = find(rendered["namespaced"], "Secret", "-engine-api-key")
    assert sorted(s["metadata"]["namespace"] for s in secrets) == [NAMESPACE, "team-a", "team-b"]
    keys = {base64.b64decode(s["data"]["api-key"]) for s in secrets}
    (key,) = keys
    assert len(key) == 48 and key.isalnum()
    (default,) = find(rendered["defaults"], "Secret", "-engine-api-key")
    assert base64.b64decode(default["data"]["api-key"]) != key, "random per install (lookup keeps it on upgrades)"


class ClusterForHelm(Emulator):
    """kmock as helm sees a cluster: a version the chart accepts, core/v1 discovery as client-go parses it."""

    async def _serve_server_version(self, request):
        return {"major": "1", "minor": "37", "gitVersion": "v1.37.0", "platform": "linux/amd64"}

    async def _serve_version(self, request):
        payload = await super()._serve_version(request)
        if isinstance(payload, dict) and payload.get("groupVersion") == "/v1":  # kmock writes "/v1"
            payload["groupVersion"] = "v1"
        return payload


async def render_against(helm, objects: list[dict], existing: list[dict], tmp_path) -> list[dict]:
    """`helm template --dry-run=server` (lookups read the cluster) against kmock holding `existing`."""
    import asyncio
    import subprocess

    import httpx
    import kmock

    cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                      "ValidatingAdmissionPolicyBinding"}
    async with ClusterForHelm() as k8s, kmock.Server(k8s) as server:
        for obj in objects:  # helm maps every kind it renders through discovery
            kind = obj["kind"]
            plural = kind.lower()[:-1] + "ies" if kind.endswith("y") else kind.lower() + "s"
            k8s.resources[f"{obj['apiVersion']}/{plural}"] = kmock.ResourceInfo(
                kind=kind, namespaced=kind not in cluster_scoped, verbs={"create", "get", "list", "patch"})
        url = str(server.url).rstrip("/")
        async with httpx.AsyncClient() as client:
            for obj in existing:
                meta = obj["metadata"]
                (await client.post(f"{url}/api/v1/namespaces/{meta['namespace']}/secrets", json=obj)).raise_for_status()
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": url}}], "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "u", "namespace": NAMESPACE}}]}))
        result = await asyncio.to_thread(subprocess.run, [
            str(helm), "template", "kubeinfer", str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
            "--dry-run=server", "--disable-openapi-validation", "--skip-crds"],
            capture_output=True, text=True, timeout=120,
            env={"KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


async def test_the_chart_keeps_an_existing_key_on_upgrade(helm, rendered, tmp_path):
    """On an upgrade `lookup` finds the Secret the release made: its key is read back, never drawn again."""
    helm_owned = {"labels": {"app.kubernetes.io/managed-by": "Helm"},
                  "annotations": {"meta.helm.sh/release-name": "kubeinfer", "meta.helm.sh/release-namespace": NAMESPACE}}
    earlier = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": {"api-key": "c3RhYmxlLWtleQ=="},
               "metadata": {"name": "kubeinfer-engine-api-key", "namespace": NAMESPACE, **helm_owned}}
    upgraded = await render_against(helm, rendered["defaults"], [earlier], tmp_path)
    assert one(upgraded, "Secret", "-engine-api-key")["data"] == {"api-key": "c3RhYmxlLWtleQ=="}
    fresh = await render_against(helm, rendered["defaults"], [], tmp_path)
    assert one(fresh, "Secret", "-engine-api-key")["data"]["api-key"] != "c3RhYmxlLWtleQ=="


@pytest.mark.parametrize("variant, secret, key", [("defaults", "kubeinfer-engine-api-key", "api-key"),
                                                  ("namespaced", "kubeinfer-engine-api-key", "api-key"),
                                                  ("existing-key", "my-engine-key", "token")])
def test_gateway_operator_and_engines_share_the_key(rendered, variant, secret, key):
    objects = rendered[variant]
    gateway, operator = one(objects, "Deployment", "-gateway"), one(objects, "Deployment", "-operator")
    assert env_ref(gateway, "KUBEINFER_ENGINE_API_KEY") == {"name": secret, "key": key}
    assert env_ref(operator, "KUBEINFER_ENGINE_API_KEY") == {"name": secret, "key": key}
    config = operator_config(objects)
    engine = pod_template(parse_spec("chat", {"model": {"uri": "pvc://m/x"}}), config)["spec"]["containers"][0]
    assert env_ref({"spec": {"template": {"spec": {"containers": [engine]}}}}, "KUBEINFER_API_KEY") == \
        {"name": secret, "key": key}
    if variant == "existing-key":
        assert not find(objects, "Secret", "-engine-api-key"), "the user's Secret, not the chart's"


def test_without_a_key_nothing_refers_to_one(rendered):
    objects = rendered["open"]
    assert not find(objects, "Secret")
    for deployment in find(objects, "Deployment"):
        assert env_ref(deployment, "KUBEINFER_ENGINE_API_KEY") is None
    assert operator_config(objects).engine_api_key_secret == ""


# -- the NetworkPolicy flags ---------------------------------------------------------------------------------
def pod_labels(objects: list[dict], component: str) -> dict:
    return one(objects, "Deployment", f"-{component}")["spec"]["template"]["metadata"]["labels"]


def test_network_policy_admits_this_releases_gateway_and_operator_and_the_scrapers(rendered):
    objects = rendered["defaults"]
    config = operator_config(objects)
    assert config.network_policy is True
    gateway_peer, operator_peer = config.api_peers
    for peer, component in ((gateway_peer, "gateway"), (operator_peer, "operator")):
        assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
        assert names.matches(pod_labels(objects, component), peer["podSelector"]["matchLabels"])
    assert not names.matches(pod_labels(objects, "gateway"), operator_peer["podSelector"]["matchLabels"])
    assert config.metrics_peers[0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    owner = {"apiVersion": "serving.kubeinfer.io/v1alpha1", "kind": "InferenceModel",
             "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1"}}
    built = network_policy(owner, parse_spec("chat", {"model": {"uri": "pvc://m/x"}}), config)
    kubernetes_validate.validate(built, KUBE_VERSION, strict=True)


def test_network_policy_peers_and_switch_come_from_values(rendered):
    config = operator_config(rendered["policy"])
    assert config.api_peers[2:] == ({"namespaceSelector": {"matchLabels": {"gateway": "envoy"}}},)
    assert config.metrics_peers == ({"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}},)
    assert operator_config(rendered["open"]).network_policy is False


def test_the_kv_event_ports_admit_this_releases_gateway_alone(rendered):
    """Issue #44: the KV-event ports took every API peer; now only the gateway (and extraKvEventsPeers)."""
    defaults, policy = operator_config(rendered["defaults"]), operator_config(rendered["policy"])
    (gateway_peer,) = defaults.kv_events_peers
    assert gateway_peer == defaults.api_peers[0]
    assert gateway_peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    assert names.matches(pod_labels(rendered["defaults"], "gateway"), gateway_peer["podSelector"]["matchLabels"])
    assert not names.matches(pod_labels(rendered["defaults"], "operator"), gateway_peer["podSelector"]["matchLabels"])
    assert policy.kv_events_peers == (gateway_peer, {"namespaceSelector": {"matchLabels": {"indexer": "llm-d"}}})
    assert not set(map(str, policy.api_peers[1:])) & set(map(str, policy.kv_events_peers))  # operator, envoy: no


# -- the operator's policy -----------------------------------------------------------------------------------
def test_policy_values_become_operator_flags(rendered):
    assert operator_config(rendered["policy"]).policy == PodPolicy(
        ("/srv/models",), ("registry.corp/ml/",), ("inference",), True, True)
    assert operator_config(rendered["defaults"]).policy == PodPolicy(), "file:// off, engine image only"


@pytest.mark.parametrize("bad, complaint", [
    ({"operator": {"policy": {"hostPathPrefixes": ["models"]}}}, "hostPathPrefixes"),
    ({"operator": {"policy": {"allowAll": True}}}, "allowAll"),
    ({"networkPolicy": {"metricsPeers": [{"podSelecter": {}}]}}, "podSelecter"),
    ({"engineApiKey": {"key": "a key"}}, "key"),
])
def test_values_schema_refuses_bad_security_values(helm, bad, complaint, tmp_path):
    result = run_helm(helm, "template", "kubeinfer", str(CHART), values=bad, tmp_path=tmp_path, check=False)
    assert result.returncode != 0 and complaint in result.stderr, result.stderr


# -- RBAC: aggregation switch, the admission policy on pod patches -------------------------------------------
def test_aggregation_to_namespace_editors_can_be_turned_off(rendered):
    edit = one(rendered["defaults"], "ClusterRole", "-inferencemodel-edit")
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert not find(rendered["open"], "ClusterRole", "-inferencemodel-edit")


def cel(expression: str, activation: dict):
    env = celpy.Environment()
    return env.program(env.compile(expression)).evaluate(activation)


def admitted(policy: dict, username: str, old: dict, new: dict) -> list[str]:
    """The admission policy's verdict on one pod UPDATE: [] when admitted, else the failed messages."""
    request = {"userInfo": {"username": username}}
    activation = {"object": celpy.json_to_cel(new), "oldObject": celpy.json_to_cel(old),
                  "request": celpy.json_to_cel(request)}
    spec = policy["spec"]
    if not all(cel(c["expression"], activation) for c in spec["matchConditions"]):
        return []
    variables = {v["name"]: cel(v["expression"], activation) for v in spec["variables"]}
    activation["variables"] = celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in variables.items()})
    return [v["message"] for v in spec["validations"] if not cel(v["expression"], activation)]


ENGINE_POD = {"metadata": {"name": "chat-0", "labels": {**names.pod_labels("chat"), names.ROLE_LABEL: "standby"},
                           "annotations": {"prometheus.io/scrape": "true"}},
              "spec": {"containers": [{"name": "engine", "image": "ghcr.io/kubeinfer/engine:0.1.0"}]}}
OPERATOR = f"system:serviceaccount:{NAMESPACE}:kubeinfer-operator"


def changed(pod: dict, edit) -> dict:
    new = copy.deepcopy(pod)
    edit(new)
    return new


def test_the_operator_may_only_relabel_and_annotate_its_own_pods(rendered):
    policy = one(rendered["defaults"], "ValidatingAdmissionPolicy")
    binding = one(rendered["defaults"], "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    promote = changed(ENGINE_POD, lambda p: p["metadata"]["labels"].update({names.ROLE_LABEL: "active"}))
    place = changed(promote, lambda p: p["metadata"]["annotations"].update(
        {names.ADAPTERS_ANNOTATION: "sql", names.DELETION_COST_ANNOTATION: "100"}))
    assert admitted(policy, OPERATOR, ENGINE_POD, promote) == []
    assert admitted(policy, OPERATOR, promote, place) == []
    bare = {"metadata": {"name": "x", "labels": {names.MANAGED_BY_LABEL: names.MANAGER}}, "spec": {}}
    assert admitted(policy, OPERATOR, bare, changed(bare, lambda p: p["metadata"].update(
        {"annotations": {names.ADAPTERS_ANNOTATION: "a"}}))) == [], "pods without annotations yet"

    someone_elses = {"metadata": {"name": "db-0", "labels": {"app": "db"}}, "spec": ENGINE_POD["spec"]}
    refusals = {
        "not its pod": (someone_elses, changed(someone_elses, lambda p: p["metadata"]["labels"].update(
            {names.ROLE_LABEL: "active"}))),
        "another label": (ENGINE_POD, changed(ENGINE_POD, lambda p: p["metadata"]["labels"].update(
            {names.INSTANCE_LABEL: "other-model"}))),
        "a label removed": (ENGINE_POD, changed(ENGINE_POD, lambda p: p["metadata"]["labels"].pop(names.MODEL_LABEL))),
        "another annotation": (ENGINE_POD, changed(ENGINE_POD, lambda p: p["metadata"]["annotations"].update(
            {"sidecar.istio.io/inject": "true"}))),
        "the image": (ENGINE_POD, changed(ENGINE_POD, lambda p: p["spec"]["containers"][0].update(
            {"image": "docker.io/attacker/miner"}))),
    }
    for what, (old, new) in refusals.items():
        assert admitted(policy, OPERATOR, old, new), what
    assert admitted(policy, "system:serviceaccount:llm:someone-else", *refusals["the image"]) == [], \
        "only the operator's service account is matched"
    assert not find(rendered["open"], "ValidatingAdmissionPolicy")


def test_notes_say_what_the_platform_must_add(helm, tmp_path):
    result = run_helm(helm, "install", "kubeinfer", str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
                      tmp_path=tmp_path)
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "Secret kubeinfer-engine-api-key" in notes and "CNI that enforces NetworkPolicy" in notes
    assert "namespace-scoped (operator.watchNamespaces)" in notes
