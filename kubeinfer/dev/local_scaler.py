"""Scale to zero without a cluster, for `kubeinfer local-stack --scale-to-zero SECONDS`.

An engine replica with no request running or waiting for SECONDS is stopped (it drains first); while
any is stopped, the gateway's `kubeinfer_gateway_requests_held` tells that a request is waiting, and the
stopped replicas are started again (a cold start: the model loads). The gateway holds the request
meanwhile, exactly as it does in a cluster while the operator brings a pod back.
"""
from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

ACTIVITY = ("vllm:num_requests_running", "vllm:num_requests_waiting")
HELD = "kubeinfer_gateway_requests_held"


def metric_sum(text: str, names: tuple[str, ...]) -> float:
    return sum(sample.value for family in text_string_to_metric_families(text) if family.name in names
               for sample in family.samples)


@dataclass
class Replica:
    url: str
    command: list[str]
    env: dict[str, str]
    process: subprocess.Popen | None = None
    last_busy: float = field(default_factory=time.monotonic)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self.process = subprocess.Popen(self.command, env=self.env)
        self.last_busy = time.monotonic()

    def stop(self) -> None:
        self.process.terminate()  # SIGTERM: the engine drains, then exits 0
        self.process.wait(timeout=60)


class LocalScaler:
    """One `tick` per interval: stop replicas idle for `idle_seconds`, start them when requests are held."""

    def __init__(self, replicas: list[Replica], gateway_metrics_url: str, idle_seconds: float,
                 log: Callable[[str], None] = print) -> None:
        self.replicas, self.gateway_metrics_url, self.idle_seconds, self.log = replicas, gateway_metrics_url, \
            idle_seconds, log
        self.stopped: list[Replica] = []

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for replica in [r for r in self.replicas if r.running]:
            if self._activity(replica.url) != 0:  # busy, or unreadable: never stop on no data
                replica.last_busy = now
            elif now - replica.last_busy >= self.idle_seconds:
                self.log(f"local-stack: {replica.url} idle for {self.idle_seconds:g} s: stopping it (scale to zero)")
                replica.stop()
                self.stopped.append(replica)
        if self.stopped and self._held() > 0:
            for replica in self.stopped:
                self.log(f"local-stack: a request is held at the gateway: starting {replica.url} again")
                replica.start()
            self.stopped = []

    def _activity(self, url: str) -> float | None:
        try:
            return metric_sum(httpx.get(url + "/metrics", timeout=2).text, ACTIVITY)
        except httpx.HTTPError:
            return None

    def _held(self) -> float:
        try:
            return metric_sum(httpx.get(self.gateway_metrics_url, timeout=2).text, (HELD,))
        except httpx.HTTPError:
            return 0.0
