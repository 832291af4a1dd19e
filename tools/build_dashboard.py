"""Write manifests/dashboards/kubeinfer.json, the Grafana dashboard, from the panel list below.

The dashboard is code so that its layout, units and queries stay consistent; edit this file, run
`python tools/build_dashboard.py`, then `python tools/sync_chart.py` to refresh the chart's copy.
tests/chart/test_manifests.py checks that the committed JSON is what this script writes.

Engine panels filter on the $namespace / $model / $pod variables; gateway panels on $namespace.
`namespace` and `pod` come from Prometheus' Kubernetes discovery, `model_name` from the engine.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUTPUT = Path(__file__).resolve().parents[1] / "manifests" / "dashboards" / "kubeinfer.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ENGINE = 'namespace=~"$namespace", model_name=~"$model", pod=~"$pod"'
GATEWAY = 'namespace=~"$namespace"'
RATE = "$__rate_interval"
GRID_WIDTH = 24


@dataclass
class Query:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass
class Panel:
    title: str
    description: str
    queries: list[Query]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | table
    width: int = 12
    height: int = 8
    max_value: float | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class Row:
    title: str
    panels: list[Panel]


def quantiles(histogram: str, by: str, legend: str) -> list[Query]:
    """p50 / p95 / p99 of a histogram, one series per `by` group."""
    return [Query(f"histogram_quantile({q}, sum by ({by}, le) (rate({histogram}_bucket{{{ENGINE}}}[{RATE}])))",
                  f"p{round(q * 100)} {legend}") for q in (0.5, 0.95, 0.99)]


def p95(histogram: str) -> str:
    return f"histogram_quantile(0.95, sum by (le) (rate({histogram}_bucket{{{ENGINE}}}[{RATE}])))"


ROWS = [
    Row("Overview", [
        Panel("Requests / s", "Finished requests per second, all finish reasons.",
              [Query(f"sum(rate(vllm:request_success_total{{{ENGINE}}}[{RATE}]))")], "reqps", "stat", 4, 4),
        Panel("Generated tokens / s", "Output tokens per second over the selected pods.",
              [Query(f"sum(rate(vllm:generation_tokens_total{{{ENGINE}}}[{RATE}]))")], "short", "stat", 4, 4),
        Panel("TTFT p95", "95th percentile time to first token.",
              [Query(p95("vllm:time_to_first_token_seconds"))], "s", "stat", 4, 4),
        Panel("Running", "Requests in running batches.",
              [Query(f"sum(vllm:num_requests_running{{{ENGINE}}})")], "short", "stat", 4, 4),
        Panel("Waiting", "Requests queued for a batch slot.",
              [Query(f"sum(vllm:num_requests_waiting{{{ENGINE}}})")], "short", "stat", 4, 4),
        Panel("KV cache used (max pod)", "KV-cache use of the fullest pod.",
              [Query(f"max(vllm:kv_cache_usage_perc{{{ENGINE}}})")], "percentunit", "stat", 4, 4, max_value=1),
    ]),
    Row("Latency", [
        Panel("Time to first token", "From arrival to the first output token (queueing and prefill).",
              quantiles("vllm:time_to_first_token_seconds", "model_name", "{{model_name}}"), "s"),
        Panel("Inter-token latency", "Time between consecutive output tokens of a request (decode speed).",
              quantiles("vllm:inter_token_latency_seconds", "model_name", "{{model_name}}"), "s"),
        Panel("End-to-end request latency", "From arrival to the last token.",
              quantiles("vllm:e2e_request_latency_seconds", "model_name", "{{model_name}}"), "s"),
        Panel("Queue time", "Time a request waited before it first ran.",
              quantiles("vllm:request_queue_time_seconds", "model_name", "{{model_name}}"), "s"),
    ]),
    Row("Throughput", [
        Panel("Tokens / s", "Prompt tokens processed and tokens generated per second.",
              [Query(f"sum by (model_name) (rate(vllm:prompt_tokens_total{{{ENGINE}}}[{RATE}]))", "prompt {{model_name}}"),
               Query(f"sum by (model_name) (rate(vllm:generation_tokens_total{{{ENGINE}}}[{RATE}]))",
                     "generated {{model_name}}")]),
        Panel("Finished requests by reason", "stop: a stop condition; length: max_tokens or the context; "
              "abort: the client went away or the request was cancelled.",
              [Query(f"sum by (model_name, finished_reason) (rate(vllm:request_success_total{{{ENGINE}}}[{RATE}]))",
                     "{{finished_reason}} {{model_name}}")], "reqps"),
        Panel("Prompt length", "Prompt tokens per finished request.",
              quantiles("vllm:request_prompt_tokens", "model_name", "{{model_name}}")),
        Panel("Generation length", "Generated tokens per finished request.",
              quantiles("vllm:request_generation_tokens", "model_name", "{{model_name}}")),
    ]),
    Row("Scheduler and KV cache", [
        Panel("Running and waiting requests", "Per pod: the running batch and the queue behind it.",
              [Query(f"sum by (pod) (vllm:num_requests_running{{{ENGINE}}})", "running {{pod}}"),
               Query(f"sum by (pod) (vllm:num_requests_waiting{{{ENGINE}}})", "waiting {{pod}}")]),
        Panel("KV-cache usage", "Fraction of KV-cache blocks in use, per pod.",
              [Query(f"max by (pod) (vllm:kv_cache_usage_perc{{{ENGINE}}})", "{{pod}}")], "percentunit",
              max_value=1),
        Panel("Prefix-cache hit rate", "Share of prompt tokens found in the prefix cache (work not recomputed).",
              [Query(f"sum by (model_name) (rate(vllm:prefix_cache_hits_total{{{ENGINE}}}[{RATE}]))"
                     f" / sum by (model_name) (rate(vllm:prefix_cache_queries_total{{{ENGINE}}}[{RATE}]))",
                     "{{model_name}}")], "percentunit", max_value=1),
        Panel("Preemptions / s", "Sequences preempted for lack of KV blocks (their work is recomputed).",
              [Query(f"sum by (pod) (rate(vllm:num_preemptions_total{{{ENGINE}}}[{RATE}]))", "{{pod}}")]),
    ]),
    Row("LoRA adapters", [
        Panel("Adapters per pod", "LoRA adapters running and waiting on each pod, and its adapter slots. "
              "The info series with the newest timestamp is the pod's current state.",
              [Query(f"topk by (namespace, pod) (1, vllm:lora_requests_info{{{ENGINE}}})", instant=True)],
              kind="table", width=24, height=7,
              extra={"transformations": [{"id": "organize", "options": {
                  "excludeByName": {"Time": True, "Value": True, "__name__": True, "instance": True, "job": True,
                                    "endpoint": True, "container": True},
                  "renameByName": {"running_lora_adapters": "running", "waiting_lora_adapters": "waiting",
                                   "max_lora": "slots"}}}]}),
    ]),
    Row("Gateway", [
        Panel("Ready engine pods", "Endpoints the gateway can route to, per pool.",
              [Query(f"inference_pool_ready_pods{{{GATEWAY}}}", "{{name}} ({{pod}})")], width=8),
        Panel("Average queue size", "Waiting requests averaged over the pool's ready pods.",
              [Query(f"inference_pool_average_queue_size{{{GATEWAY}}}", "{{name}} ({{pod}})")], width=8),
        Panel("Average KV-cache utilization", "KV-cache use averaged over the pool's ready pods.",
              [Query(f"inference_pool_average_kv_cache_utilization{{{GATEWAY}}}", "{{name}} ({{pod}})")],
              "percentunit", width=8, max_value=1),
        Panel("Routed requests / s", "Requests the gateway routed, and those it refused or that failed, by status.",
              [Query(f"sum by (model_name) (rate(inference_model_request_total{{{GATEWAY}}}[{RATE}]))",
                     "routed {{model_name}}"),
               Query(f"sum by (model_name, error_code) (rate(inference_model_request_error_total{{{GATEWAY}}}[{RATE}]))",
                     "{{error_code}} {{model_name}}")], "reqps"),
        Panel("Gateway request latency", "End-to-end latency of requests proxied by the gateway.",
              [Query(f"histogram_quantile({q}, sum by (le) (rate(inference_model_request_duration_seconds_bucket"
                     f"{{{GATEWAY}}}[{RATE}])))", f"p{round(q * 100)}") for q in (0.5, 0.95, 0.99)], "s"),
    ]),
    Row("Tenants", [
        Panel("Requests / s per tenant", "Requests per tenant (from the gateway's tenants file) by status; 429s are "
              "the tenant's own limits or shedding.",
              [Query(f"sum by (tenant, code) (rate(kubeinfer_gateway_tenant_requests_total{{{GATEWAY}}}[{RATE}]))",
                     "{{tenant}} {{code}}")], "reqps", width=8),
        Panel("Tokens / s per tenant", "Prompt and completion tokens the engines reported, per tenant; cached: prompt "
              "tokens served from the prefix cache.",
              [Query(f"sum by (tenant) (rate(kubeinfer_gateway_tenant_prompt_tokens_total{{{GATEWAY}}}[{RATE}]))",
                     "prompt {{tenant}}"),
               Query(f"sum by (tenant) (rate(kubeinfer_gateway_tenant_cached_prompt_tokens_total{{{GATEWAY}}}"
                     f"[{RATE}]))", "cached {{tenant}}"),
               Query(f"sum by (tenant) (rate(kubeinfer_gateway_tenant_completion_tokens_total{{{GATEWAY}}}[{RATE}]))",
                     "completion {{tenant}}")], width=8),
        Panel("Engine time and fallbacks", "Engine seconds used per second, per tenant; requests a fallback model "
              "served, by model and why.",
              [Query(f"sum by (tenant) (rate(kubeinfer_gateway_tenant_engine_seconds_total{{{GATEWAY}}}[{RATE}]))",
                     "engine s/s {{tenant}}"),
               Query(f"sum by (model_name, fallback, reason) (rate(kubeinfer_gateway_fallbacks_total{{{GATEWAY}}}"
                     f"[{RATE}]))", "{{model_name}} → {{fallback}} ({{reason}})")], width=8),
    ]),
    Row("Scale from zero", [
        Panel("Held requests", "Requests waiting at the gateway for a model with no ready engine (scaled to zero "
              "or starting), and scale-ups the gateway asked for through an InferenceModel's /scale.",
              [Query(f"sum(kubeinfer_gateway_requests_held{{{GATEWAY}}})", "held"),
               Query(f"sum by (model_name) (increase(kubeinfer_gateway_scale_ups_total{{{GATEWAY}}}[{RATE}]))",
                     "scale-ups {{model_name}}")], width=12),
        Panel("Hold time", "How long held requests waited for an engine before they were routed.",
              [Query(f"histogram_quantile({q}, sum by (model_name, le) (rate("
                     f"kubeinfer_gateway_hold_duration_seconds_bucket{{{GATEWAY}}}[{RATE}])))", f"p{round(q * 100)} "
                     "{{model_name}}") for q in (0.5, 0.95, 0.99)], "s", width=12),
    ]),
]


def target(query: Query, ref: str) -> dict:
    out = {"datasource": DATASOURCE, "refId": ref, "expr": query.expr, "legendFormat": query.legend or "__auto"}
    if query.instant:
        out.update(instant=True, range=False, format="table")
    else:
        out.update(range=True)
    return out


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    defaults: dict = {"unit": panel.unit}
    if panel.max_value is not None:
        defaults.update(min=0, max=panel.max_value)
    if panel.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                              "spanNulls": False}
        options = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                   "tooltip": {"mode": "multi", "sort": "desc"}}
    elif panel.kind == "stat":
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "colorMode": "value", "graphMode": "area", "textMode": "auto", "justifyMode": "auto",
                   "orientation": "auto"}
    else:
        options = {"showHeader": True, "cellHeight": "sm"}
    return {
        "id": panel_id, "type": panel.kind, "title": panel.title, "description": panel.description,
        "datasource": DATASOURCE, "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options,
        "targets": [target(q, chr(ord("A") + i)) for i, q in enumerate(panel.queries)],
        **panel.extra,
    }


def layout(rows: list[Row]) -> list[dict]:
    """Rows full width; panels left to right, wrapping at the grid's 24 columns."""
    panels, next_id, y = [], 1, 0
    for row in rows:
        panels.append({"id": next_id, "type": "row", "title": row.title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}})
        next_id, y = next_id + 1, y + 1
        x, line_height = 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            panels.append(panel_json(panel, next_id, x, y))
            next_id, x, line_height = next_id + 1, x + panel.width, max(line_height, panel.height)
        y += line_height
    return panels


def query_variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": {"query": query, "refId": f"{name}-variable"},
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*", "sort": 1,
            "current": {}, "options": [], "hide": 0, "regex": ""}


def dashboard() -> dict:
    return {
        "uid": "kubeinfer",
        "title": "kubeinfer",
        "description": "LLM serving with kubeinfer: engine latency, throughput, scheduler and KV cache, "
                       "LoRA adapters and the endpoint-picking gateway.",
        "tags": ["kubeinfer", "llm", "vllm"],
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1,
             "regex": ""},
            query_variable("namespace", "Namespace", "label_values(vllm:num_requests_running, namespace)"),
            query_variable("model", "Model",
                           'label_values(vllm:num_requests_running{namespace=~"$namespace"}, model_name)'),
            query_variable("pod", "Pod", 'label_values(vllm:num_requests_running{namespace=~"$namespace", '
                                         'model_name=~"$model"}, pod)'),
        ]},
        "panels": layout(ROWS),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the kubeinfer Grafana dashboard JSON.")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render())
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
