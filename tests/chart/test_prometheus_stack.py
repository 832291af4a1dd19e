"""A real Prometheus (Debian's `prometheus` package) scraping a stack on loopback with the chart's scrape
configuration: two engines (a tiny random model) and the gateway in front, with tenants, a fallback and a
model brought up for a held request, as in a cluster. After some traffic every panel query of
manifests/dashboards/kubeinfer.json returns series, the dashboard's variables included."""
from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest
import yaml
from chart_helpers import CHART, KUBE_VERSION, NAMESPACE, find, run_helm
from server_harness import RunningServer, free_port
from test_chart import helm  # noqa: F401 - the session's helm binary

from kubeinfer.dev.prometheus_local import CHART_MONITORS, LocalPrometheus, Target, binary, config

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "manifests" / "dashboards" / "kubeinfer.json"
NS = "serving"
RATE_INTERVAL = "15s"  # Grafana's $__rate_interval for a 1 s scrape: several samples per window
pytestmark = pytest.mark.skipif(binary() is None, reason="prometheus is not installed (Debian/Ubuntu: apt-get "
                                                          "install prometheus): the dashboard is not run against it")


@pytest.fixture(scope="module")
def chart_monitors(helm, tmp_path_factory) -> dict:  # noqa: F811
    """The endpoints of the gateway's ServiceMonitor and the engines' PodMonitor, as the chart renders them."""
    tmp = tmp_path_factory.mktemp("monitors")
    result = run_helm(helm, "template", "kubeinfer", str(CHART), "--namespace", NAMESPACE, "--kube-version",
                      KUBE_VERSION, values={"monitoring": {"serviceMonitor": {"enabled": True}}}, tmp_path=tmp)
    objects = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    [service_monitor], [pod_monitor] = find(objects, "ServiceMonitor"), find(objects, "PodMonitor")
    strip = lambda e: {k: v for k, v in e.items() if k != "port"}
    return {"gateway": strip(service_monitor["spec"]["endpoints"][0]),
            "engines": strip(pod_monitor["spec"]["podMetricsEndpoints"][0])}


def test_local_stack_uses_the_charts_scrape_configuration(chart_monitors):
    assert CHART_MONITORS == chart_monitors


def panel_queries() -> list[tuple[str, str]]:
    def panels(items):
        for panel in items:
            yield panel
            yield from panels(panel.get("panels") or [])
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in panels(dashboard["panels"])
            for target in panel.get("targets") or [] if target.get("expr")]


def variables(prometheus: LocalPrometheus) -> dict[str, str]:
    """The dashboard's variables as Grafana resolves them, each to every value its query finds ("All")."""
    dashboard = json.loads(DASHBOARD.read_text())
    values: dict[str, str] = {}
    for variable in dashboard["templating"]["list"]:
        if variable.get("type") != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query)
        assert match, query
        selector = substitute(match.group(1), values)
        found = prometheus.label_values(match.group(2), selector)
        assert found, f"variable {variable['name']}: {query} found nothing"
        # Grafana's "All": a regex of every value, escaped for RE2 inside a PromQL string literal.
        values[variable["name"]] = "(" + "|".join(re.escape(v).replace("\\", "\\\\") for v in found) + ")"
    return values


def substitute(expr: str, values: dict[str, str]) -> str:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__interval", "1s")
    for name, value in sorted(values.items(), key=lambda item: -len(item[0])):
        expr = expr.replace(f"${name}", value)
    return expr


async def traffic(gateway_url: str, key: str) -> None:
    """Completions streamed and not, chat, an unknown model, a fallback, a held request (the test brings
    its model up)."""
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=gateway_url, headers=headers, timeout=60) as http:
        async def complete(model: str, stream: bool = False) -> None:
            body = {"model": model, "prompt": "one two three four", "max_tokens": 6, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
        await asyncio.gather(*(complete("tiny", stream=i % 2 == 0) for i in range(8)))
        chat = await http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert chat.status_code == 200, chat.text
        unknown = await http.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1})
        assert unknown.status_code == 404  # an error for the error panels
        await complete("ghost")  # served by its fallback
        await complete("sleepy")  # held until its engine joins the pool


def test_every_dashboard_query_returns_series_from_a_scraped_stack(llama_dir, tmp_path, chart_monitors):
    from kubeinfer.gateway.app import Gateway, GatewayConfig
    from kubeinfer.gateway.datastore.discovery import static_endpoints

    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": [{"name": "team-a", "apiKeys": ["key-a"]}]}))
    with RunningServer(llama_dir, name="tiny", block_size=8) as tiny, \
            RunningServer(llama_dir, name="sleepy", block_size=8) as sleepy:
        async def run() -> None:
            gateway = Gateway(GatewayConfig(host="127.0.0.1", port=0, ext_proc_port=None, metrics_port=0,
                                            endpoints=[tiny.url], scrape_interval=0.1, tenants_file=str(tenants),
                                            fallbacks=[("ghost", "tiny")], hold_timeout=30))
            await gateway.start()
            # As in a cluster: an InferenceModel at zero ("sleepy") is held for, and the scale-up the gateway asks
            # for brings its pod into the pool (here: the test adds the engine, as the operator's promotion would).
            gateway.router.scalable = {"sleepy"}

            async def scale_up(model: str, held: int) -> bool:
                gateway.pool.set_members([*gateway.pool, *static_endpoints([sleepy.url])])
                return True
            gateway.router.hold.ask = scale_up
            prometheus = LocalPrometheus(config(
                [Target(f"127.0.0.1:{gateway.ports['metrics']}", NS, "kubeinfer-gateway-0")],
                [Target(tiny.url.removeprefix("http://"), NS, "tiny-0",
                        {"serving.kubeinfer.io/inference-model": "tiny"}),
                 Target(sleepy.url.removeprefix("http://"), NS, "sleepy-0",
                        {"serving.kubeinfer.io/inference-model": "sleepy"})],
                monitors=chart_monitors, interval="1s"), tmp_path / "prometheus", free_port())
            try:
                await asyncio.to_thread(prometheus.start)
                await asyncio.to_thread(prometheus.wait_until_scraping, 3)
                await traffic(f"http://127.0.0.1:{gateway.ports['proxy']}", "key-a")
                await asyncio.sleep(4)  # a few scrapes after the traffic
                await asyncio.to_thread(check_dashboard, prometheus)
            finally:
                await asyncio.to_thread(prometheus.stop)
                await gateway.stop()
        asyncio.run(run())


def check_dashboard(prometheus: LocalPrometheus) -> None:
    up = prometheus.query("up")
    assert {(s["metric"]["job"], s["value"][1]) for s in up} == {("kubeinfer-gateway", "1"), ("kubeinfer-engine", "1")}
    engines = prometheus.query('vllm:num_requests_running{job="kubeinfer-engine"}')
    assert {s["metric"]["inference_model"] for s in engines} == {"tiny", "sleepy"}  # the PodMonitor's relabeling
    values = variables(prometheus)
    empty = []
    for title, expr in panel_queries():
        deadline = time.monotonic() + 10
        while not (result := prometheus.query(substitute(expr, values))) and time.monotonic() < deadline:
            time.sleep(0.5)  # a rate needs two scrapes of a series that appeared late
        if not result:
            empty.append(f"{title}: {expr}")
    assert not empty, "panels without series:\n" + "\n".join(empty)
