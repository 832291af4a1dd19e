"""A Prometheus beside a stack on this machine: its configuration, built from the chart's monitors, and
the process (Debian's `prometheus` package, or any prometheus binary on PATH).

In a cluster the Prometheus Operator turns the chart's ServiceMonitor (gateway) and PodMonitor
(engines) into scrape configurations, with Kubernetes discovery giving each target its `namespace` and
`pod`. Here the targets are static loopback addresses, given the same labels, and each monitor's path
and relabelings are carried over as they are, so the dashboard's queries and the alert rules meet the
series they would meet in a cluster. `kubeinfer local-stack --prometheus` uses it; so do the tests,
with the monitors of the rendered chart.
"""
from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
RULES = REPO_ROOT / "manifests" / "alerts" / "kubeinfer-rules.yaml"
POD_LABEL_META = "__meta_kubernetes_pod_label_"
# The endpoints of the chart's monitors (charts/kubeinfer/templates/monitoring/servicemonitor.yaml);
# tests/chart/test_prometheus_stack.py checks that they match what the chart renders.
CHART_MONITORS = {
    "gateway": {"path": "/metrics", "interval": "15s", "scrapeTimeout": "10s",
                "relabelings": [{"targetLabel": "job", "replacement": "kubeinfer-gateway"}]},
    "engines": {"path": "/metrics", "interval": "15s", "scrapeTimeout": "10s",
                "relabelings": [{"targetLabel": "job", "replacement": "kubeinfer-engine"},
                                {"sourceLabels": [POD_LABEL_META + "serving_kubeinfer_io_inference_model"],
                                 "targetLabel": "inference_model"}]},
}
_RELABEL_KEYS = {"sourceLabels": "source_labels", "targetLabel": "target_label", "replacement": "replacement",
                 "regex": "regex", "action": "action", "separator": "separator", "modulus": "modulus"}


@dataclass
class Target:
    address: str  # host:port
    namespace: str
    pod: str
    pod_labels: dict[str, str] = field(default_factory=dict)  # what Kubernetes discovery would expose

    def labels(self) -> dict[str, str]:
        labels = {"namespace": self.namespace, "pod": self.pod}
        for key, value in self.pod_labels.items():  # as discovery names them: non-alphanumerics become _
            labels[POD_LABEL_META + "".join(c if c.isalnum() else "_" for c in key)] = value
        return labels


def scrape_config(job: str, endpoint: dict, targets: list[Target], interval: str | None = None) -> dict:
    """One Prometheus scrape configuration from a monitor's endpoint (path, interval, timeout,
    relabelings), for static targets. `interval` overrides the monitor's (tests scrape every second)."""
    interval = interval or endpoint.get("interval", "15s")
    timeout = endpoint.get("scrapeTimeout", "10s")
    if _seconds(timeout) > _seconds(interval):
        timeout = interval  # Prometheus refuses a timeout longer than the interval
    return {"job_name": job, "metrics_path": endpoint.get("path", "/metrics"), "scrape_interval": interval,
            "scrape_timeout": timeout,
            "static_configs": [{"targets": [t.address], "labels": t.labels()} for t in targets],
            "relabel_configs": [{_RELABEL_KEYS[k]: v for k, v in r.items() if k in _RELABEL_KEYS}
                                for r in endpoint.get("relabelings") or []]}


def config(gateway: list[Target], engines: list[Target], monitors: dict | None = None,
           interval: str | None = None, rules: Path | None = RULES) -> dict:
    monitors = monitors or CHART_MONITORS
    scrape_interval = interval or "15s"
    document = {"global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
                "scrape_configs": [scrape_config("gateway", monitors["gateway"], gateway, interval),
                                   scrape_config("engines", monitors["engines"], engines, interval)]}
    if rules is not None and rules.is_file():
        document["rule_files"] = [str(rules)]
    return document


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for unit in ("ms", "s", "m", "h"):
        if duration.endswith(unit) and duration[:-len(unit)].replace(".", "").isdigit():
            return float(duration[:-len(unit)]) * units[unit]
    raise ValueError(f"not a Prometheus duration: {duration!r}")


def binary() -> str | None:
    return shutil.which("prometheus")


class LocalPrometheus:
    """`prometheus` on 127.0.0.1:port with `document` as its configuration and its data under `directory`."""

    def __init__(self, document: dict, directory: Path, port: int) -> None:
        self.directory, self.port = Path(directory), port
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config_path = self.directory / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(document, sort_keys=False))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> LocalPrometheus:
        executable = binary()
        if executable is None:
            raise FileNotFoundError("no prometheus binary on PATH (Debian/Ubuntu: apt-get install prometheus)")
        self.log = open(self.directory / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [executable, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}: "
                                   f"{(self.directory / 'prometheus.log').read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus did not become ready on {self.url} within {timeout:g} s")

    def wait_until_scraping(self, targets: int, timeout: float = 30.0) -> None:
        """Until `targets` targets have been scraped successfully (discovery hands Prometheus its targets
        in batches, the first about 5 s after the start)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            active = httpx.get(self.url + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            if sum(t["health"] == "up" for t in active) >= targets:
                return
            time.sleep(0.3)
        raise TimeoutError(f"prometheus did not scrape {targets} targets within {timeout:g} s: {active}")

    def query(self, expr: str) -> list[dict]:
        response = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        if body.get("status") != "success":
            raise ValueError(f"{expr}: {body.get('error')}")
        return body["data"]["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        response = httpx.get(self.url + f"/api/v1/label/{label}/values", params={"match[]": match}, timeout=10)
        return response.json()["data"]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if getattr(self, "log", None):
            self.log.close()
