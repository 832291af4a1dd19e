"""manifests/: example InferenceModels against the CRD (schema, defaults, CEL rules, the operator's own
parser), the Grafana dashboard and the Prometheus alert rules (PromQL parsed by a real parser, metric
names checked against what the engine and gateway export)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

import crd_schema
import monitoring_checks as promql
from repo_tools import load_tool

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
CRD = ROOT / "crds" / "inferencemodels.serving.kubeinfer.io.yaml"
DASHBOARD = MANIFESTS / "dashboards" / "kubeinfer.json"
RULES = MANIFESTS / "alerts" / "kubeinfer-rules.yaml"
EXAMPLES = sorted((MANIFESTS / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def exported() -> dict[str, str]:
    """Every series name the engine (DESIGN.md's contract) and the gateway (its registry) export, and
    Prometheus' own `up` of each scrape target."""
    return {**promql.engine_names(), **promql.gateway_names(), "up": "gauge"}


# -- example InferenceModels ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def im_schema() -> dict:
    if not CRD.exists():
        pytest.skip(f"{CRD.relative_to(ROOT)} does not exist yet (the operator's CRD)")
    return crd_schema.version_schema(crd_schema.load_crd(CRD), "v1alpha1")


def _problems(schema: dict, obj: dict) -> list[str]:
    """Everything the API server would refuse: schema errors (unknown fields included) and CEL rules."""
    validator = jsonschema.Draft202012Validator(crd_schema.json_schema(schema))
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]
    return errors + crd_schema.cel_violations(schema, crd_schema.apply_defaults(schema, obj))


def test_there_are_cpu_and_gpu_examples():
    names = {path.name for path in EXAMPLES}
    assert {"smollm2-cpu.yaml", "qwen2-gpu-lora.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_a_valid_inference_model(path, im_schema):
    docs = list(yaml.safe_load_all(path.read_text()))
    assert len(docs) == 1, "one InferenceModel per example file"
    obj = docs[0]
    assert (obj["apiVersion"], obj["kind"]) == ("serving.kubeinfer.io/v1alpha1", "InferenceModel")
    assert "namespace" not in obj["metadata"], "examples are applied with kubectl -n; they must not pin one"
    assert _problems(im_schema, obj) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_accepted_by_the_operator(path, im_schema):
    """The operator parses the stored (defaulted) spec without a SpecError: no Ready=False surprise."""
    from kubeinfer.operator.spec import parse_spec

    obj = crd_schema.apply_defaults(im_schema, yaml.safe_load(path.read_text()))
    spec = parse_spec(obj["metadata"]["name"], obj["spec"])
    assert spec is not None


def test_gpu_example_shows_adapters_standby_and_autoscaling(im_schema):
    spec = yaml.safe_load((MANIFESTS / "examples" / "qwen2-gpu-lora.yaml").read_text())["spec"]
    assert spec["engine"]["resources"]["gpus"] >= 1
    assert len(spec["adapters"]) >= 2 and spec["standby"]["replicas"] >= 1
    assert spec["minReplicas"] <= spec["replicas"] <= spec["maxReplicas"] and "autoscaling" in spec
    pool = spec["adapterPool"]
    # Every adapter copy must fit on the active pods, or placement cannot be satisfied.
    assert len(spec["adapters"]) * pool["replicasPerAdapter"] <= spec["replicas"] * pool["maxLorasPerReplica"]


@pytest.mark.parametrize("mutate, expected", [
    (lambda o: o["spec"].update(replica=2), "Additional properties"),
    (lambda o: o["spec"]["model"].update(uri="http://example.com/model"), "does not match"),
    (lambda o: o["spec"].update(replicas=5, maxReplicas=2), "at most spec.maxReplicas"),
    (lambda o: o["spec"].update(adapters=[{"name": "a", "uri": "pvc://c/a"}, {"name": "a", "uri": "pvc://c/b"}]),
     "unique"),
    (lambda o: o["metadata"].update(name="Bad_Name"), "DNS label"),
], ids=["misspelt-field", "bad-uri-scheme", "replicas-over-max", "duplicate-adapter", "bad-name"])
def test_validation_refuses_what_the_api_server_refuses(mutate, expected, im_schema):
    """The checks above can fail: each broken variant of the CPU example is refused, with a reason."""
    obj = yaml.safe_load((MANIFESTS / "examples" / "smollm2-cpu.yaml").read_text())
    mutate(obj)
    problems = _problems(im_schema, obj)
    assert any(expected in p for p in problems), problems


# -- the Grafana dashboard -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def _queries(dashboard: dict) -> list[str]:
    """Every PromQL query: panel targets, and the selector inside each label_values() variable."""
    exprs = [t["expr"] for p in _panels(dashboard) for t in p["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"])
            assert match, f"variable {variable['name']}: expected label_values(selector, label)"
            exprs.append(match.group(1))
    return exprs


def test_dashboard_is_what_the_generator_writes(dashboard):
    build = load_tool("build_dashboard")
    assert DASHBOARD.read_text() == build.render(), "run: python tools/build_dashboard.py"


def test_dashboard_layout_is_valid(dashboard):
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area


def _through_grafana_schema(dashboard: dict) -> dict:
    """Decode and re-encode with Grafana's dashboard types (grafana-foundation-sdk, generated from
    Grafana's schema): whatever they do not know is dropped on the way."""
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    plugins.register_default_plugins()  # panel options and Prometheus queries decode to their own types
    return json.loads(json.dumps(Dashboard.from_json(dashboard), cls=JSONEncoder))


def _dropped(original, decoded, path: str = "") -> list[str]:
    if isinstance(original, dict) and isinstance(decoded, dict):
        return [p for key, value in original.items()
                for p in ([f"{path}.{key}"] if key not in decoded else _dropped(value, decoded[key], f"{path}.{key}"))]
    if isinstance(original, list) and isinstance(decoded, list):
        return [p for i, (a, b) in enumerate(zip(original, decoded)) for p in _dropped(a, b, f"{path}[{i}]")]
    return []


def test_dashboard_has_only_fields_grafana_knows(dashboard):
    assert _dropped(dashboard, _through_grafana_schema(dashboard)) == []
    misspelt = json.loads(json.dumps(dashboard))
    misspelt["panels"][1]["options"]["colourMode"] = "value"
    assert _dropped(misspelt, _through_grafana_schema(misspelt)) == [".panels[1].options.colourMode"]


def test_dashboard_panels_use_the_datasource_variable_and_defined_variables(dashboard):
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "model", "pod"} <= variables
    for panel in _panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(?!__)(\w+)", target["expr"])) | set(re.findall(r"\$\{(\w+)\}", target["expr"]))
            assert used <= variables, f"{panel['title']}: undefined variables {used - variables}"


def test_dashboard_queries_parse_and_read_only_exported_metrics(dashboard, exported):
    for expr in _queries(dashboard):
        names = promql.metric_names(expr)
        assert names, f"no metric in {expr}"
        assert names <= set(exported), f"{expr}: not exported: {names - set(exported)}"
        assert promql.unrated_counters(expr, exported) == [], f"{expr}: counter read without rate()"


def test_dashboard_engine_queries_follow_the_model_and_pod_variables(dashboard):
    for panel in _panels(dashboard):
        for target in panel["targets"]:
            for selector in promql.selectors(target["expr"]):
                labels = promql.matchers(selector)
                if selector.name.startswith("vllm:"):
                    assert labels.get("model_name") == "$model" and labels.get("pod") == "$pod", \
                        f"{panel['title']}: {selector.name} ignores the $model / $pod variables"
                assert labels.get("namespace") == "$namespace", f"{panel['title']}: {selector.name} ignores $namespace"


def test_dashboard_covers_every_signal_operators_need(dashboard):
    used = set().union(*(promql.metric_names(e) for e in _queries(dashboard)))
    wanted = {f"{h}_bucket" for h in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                                       "vllm:e2e_request_latency_seconds")}
    wanted |= {"vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_requests_running",
               "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
               "vllm:prefix_cache_queries_total", "vllm:lora_requests_info", "vllm:num_preemptions_total",
               "vllm:request_success_total", "inference_pool_average_queue_size",
               "inference_pool_average_kv_cache_utilization", "inference_pool_ready_pods"}
    assert wanted - used == set()
    quantiles = {float(q) for e in _queries(dashboard) for q in re.findall(r"histogram_quantile\(([0-9.]+)", e)}
    assert {0.5, 0.95, 0.99} <= quantiles


def test_promql_checks_catch_mistakes(exported):
    """The checks used above really fail on wrong queries."""
    assert promql.metric_names("rate(vllm:gpu_cache_usage_perc[5m])") - set(exported)  # an old vLLM name
    assert promql.unrated_counters("sum(vllm:prompt_tokens_total)", exported) == ["vllm:prompt_tokens_total"]
    assert promql.output_labels("sum by (model_name) (vllm:num_requests_waiting) > 5") == {"model_name"}
    with pytest.raises(ValueError):
        promql.parse("sum by (model_name (vllm:num_requests_waiting)")


# -- Prometheus alert rules ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rules() -> list[dict]:
    document = yaml.safe_load(RULES.read_text())
    assert set(document) == {"groups"}, "a Prometheus rule file has only `groups`"
    groups = document["groups"]
    assert len({g["name"] for g in groups}) == len(groups), "group names must be unique"
    return [rule for group in groups for rule in group["rules"]]


DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")


def test_alert_rules_have_the_shape_prometheus_loads(rules):
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), "alert names must be unique"
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"Kubeinfer[A-Z][A-Za-z0-9]+", rule["alert"])
        assert DURATION.match(rule["for"]), f"{rule['alert']}: bad duration {rule['for']!r}"
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert {"summary", "description"} <= set(rule["annotations"])
        for text in rule["annotations"].values():
            assert text.count("{{") == text.count("}}"), f"{rule['alert']}: unbalanced template braces"


def test_alert_expressions_parse_and_read_only_exported_metrics(rules, exported):
    for rule in rules:
        names = promql.metric_names(rule["expr"])
        assert names and names <= set(exported), f"{rule['alert']}: not exported: {names - set(exported)}"
        assert promql.unrated_counters(rule["expr"], exported) == [], f"{rule['alert']}: counter without rate()"


def test_alert_annotations_only_print_labels_the_expression_keeps(rules):
    for rule in rules:
        kept = promql.output_labels(rule["expr"])
        if kept is None:
            continue  # an unaggregated selector keeps every label
        printed = set().union(*(promql.template_labels(t) for t in rule["annotations"].values()))
        assert printed <= kept, f"{rule['alert']}: prints {printed - kept}, which `{rule['expr'].strip()}` drops"


def test_alerts_cover_the_failure_modes(rules):
    by_metric = {name for rule in rules for name in promql.metric_names(rule["expr"])}
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:num_preemptions_total", "inference_pool_ready_pods",
            "inference_model_request_error_total", "up"} <= by_metric
