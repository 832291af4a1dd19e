"""`kubeinfer local-stack` (`make run`) as a newcomer runs it: two engine replicas with one adapter each and
the gateway in front; the printed examples work for the base model and both adapters; Ctrl-C stops all."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace

import httpx
import openai
import pytest
from server_harness import free_port

from kubeinfer.dev.demo_model import DemoRecipe, build_demo_model
from kubeinfer.dev.local_stack import placements
from kubeinfer.dev.prometheus_local import RULES, config as prometheus_config

# A demo model trained for a few steps only: the stack, not the model's quality, is under test here.
QUICK = replace(DemoRecipe(), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                vocab_size=400, max_position_embeddings=256, context=32, batch_size=8, base_steps=4, adapter_steps=2,
                lora_rank=4, lora_alpha=8.0, max_chars_per_style=5_000)


def test_placements_put_adapters_on_different_replicas(tmp_path):
    adapters = [tmp_path / name for name in ("a", "b", "c")]
    assert placements(adapters, 2) == [[adapters[0], adapters[2]], [adapters[1]]]


def test_local_stack_serves_base_and_adapters_then_stops(tmp_path):
    demo = build_demo_model(tmp_path / "demo", recipe=QUICK, progress=False)
    port, metrics_port, engines = free_port(), free_port(), [free_port(), free_port()]
    process = subprocess.Popen(
        [sys.executable, "-m", "kubeinfer.cli", "local-stack", "--demo-dir", str(demo), "--port", str(port),
         "--metrics-port", str(metrics_port), "--engine-ports", ",".join(map(str, engines))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        printed = []
        deadline = time.time() + 120
        for line in process.stdout:
            printed.append(line)
            if "metrics:" in line or time.time() > deadline:
                break
        text = "".join(printed)
        assert f"kubeinfer is serving on http://127.0.0.1:{port}" in text, text

        url = f"http://127.0.0.1:{port}"
        models = {m["id"]: m["parent"] for m in httpx.get(url + "/v1/models").json()["data"]}
        assert models == {"demo": None, "legal": "demo", "python": "demo"}
        # The printed curl commands work as printed.
        for command in re.findall(r"curl -s \S+/v1/chat/completions .*?\n\s+-d '.*?'", text, re.S):
            body = re.search(r"-d '(.*)'", command).group(1)
            response = httpx.post(url + "/v1/chat/completions", content=body,
                                  headers={"Content-Type": "application/json"}, timeout=60)
            assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        answers, pods = {}, {}
        for model in models:
            raw = client.chat.completions.with_raw_response.create(
                model=model, max_tokens=4, temperature=0, logprobs=True,
                messages=[{"role": "user", "content": "Tell me something."}])
            answers[model] = raw.parse().choices[0].logprobs.content[0].logprob
            pods[model] = raw.headers["x-gateway-destination-endpoint"]
        assert pods["legal"] != pods["python"]  # the adapters live on different replicas
        # Choosing an adapter changes the model's answer (a barely trained model: compare its logprobs;
        # test_demo_model.py checks the styles of the real one).
        assert len(set(answers.values())) == 3, answers
    finally:
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
    assert code == 0
    for port_ in engines + [port]:
        try:
            httpx.get(f"http://127.0.0.1:{port_}/health", timeout=1)
            raise AssertionError(f"port {port_} still serving after Ctrl-C")
        except httpx.TransportError:
            pass


def test_local_stack_scales_an_idle_replica_to_zero_and_back_on_a_held_request(tmp_path):
    """`--scale-to-zero 1`: idle engines stop; the next request is held at the gateway (not refused),
    the engines start again, and it is answered; the gateway's metrics show the hold."""
    demo = build_demo_model(tmp_path / "demo", recipe=QUICK, progress=False)
    port, metrics_port, engines = free_port(), free_port(), [free_port(), free_port()]
    process = subprocess.Popen(
        [sys.executable, "-m", "kubeinfer.cli", "local-stack", "--demo-dir", str(demo), "--port", str(port),
         "--metrics-port", str(metrics_port), "--engine-ports", ",".join(map(str, engines)), "--scale-to-zero", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        printed, deadline = [], time.time() + 120
        for line in process.stdout:
            printed.append(line)
            if "stopping it (scale to zero)" in line and sum("scale to zero" in p for p in printed) == 2:
                break
            assert time.time() < deadline, "".join(printed)

        def stopped(engine: int) -> bool:
            try:
                httpx.get(f"http://127.0.0.1:{engine}/health", timeout=1)
                return False
            except httpx.TransportError:
                return True

        stop_deadline = time.time() + 60  # each drains, then exits
        while not all(stopped(e) for e in engines):
            assert time.time() < stop_deadline, "the idle replicas did not stop"
            time.sleep(0.2)
        while 'inference_pool_ready_pods{name="default"} 0.0' not in httpx.get(
                f"http://127.0.0.1:{metrics_port}/metrics").text:  # the gateway has seen them go
            assert time.time() < stop_deadline, "the gateway still counts the stopped replicas as ready"
            time.sleep(0.2)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                              json={"model": "demo", "prompt": "Hello", "max_tokens": 2})
        assert response.status_code == 200, response.text
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert 'kubeinfer_gateway_hold_duration_seconds_count{model_name="demo"} 1.0' in metrics
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()


def _serving(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
        return True
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_local_stack_stops_on_a_signal_to_its_own_process(tmp_path, sig):
    """Started as a non-interactive shell starts a background job (`kubeinfer local-stack &`: SIGINT
    inherited ignored), one signal sent to its pid alone (not its process group) stops the gateway and
    both engines. Before: the lone SIGINT was ignored and the stack kept serving."""
    demo = build_demo_model(tmp_path / "demo", recipe=QUICK, progress=False)
    port, metrics_port, engines = free_port(), free_port(), [free_port(), free_port()]
    process = subprocess.Popen(
        [sys.executable, "-m", "kubeinfer.cli", "local-stack", "--demo-dir", str(demo), "--port", str(port),
         "--metrics-port", str(metrics_port), "--engine-ports", ",".join(map(str, engines))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        printed, deadline = [], time.time() + 120
        for line in process.stdout:
            printed.append(line)
            if "metrics:" in line:
                break
            assert time.time() < deadline, "".join(printed)
        assert _serving(port), "".join(printed)
        children = _children(process.pid)
        assert len(children) == 3  # two engines, the gateway
        process.send_signal(sig)
        assert process.wait(timeout=60) == 0
        assert not any(_serving(p) for p in [port, *engines])
    finally:
        if process.poll() is None:  # the parent is stuck: stop what it started too
            for pid in [*_children(process.pid), process.pid]:
                os.kill(pid, signal.SIGKILL)
            process.wait()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as file:
        return [int(child) for child in file.read().split()]


def test_the_local_prometheus_loads_the_repositorys_alert_rules():
    """The local Prometheus finds the rules from wherever its module sits (a missing file is skipped quietly, so
    a move of the module once left the stack without alerts)."""
    assert RULES.is_file()
    assert prometheus_config([], []).get("rule_files") == [str(RULES)]


@pytest.mark.slow  # about 30 s: the stack, then Prometheus' first target batch
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed (apt-get install prometheus)")
def test_local_stack_starts_a_prometheus_beside_it(tmp_path):
    """`--prometheus PORT`: the printed URL is a Prometheus that scrapes the gateway and both engines with
    the chart's job names and loads the alert rules; it stops with the stack."""
    demo = build_demo_model(tmp_path / "demo", recipe=QUICK, progress=False)
    port, metrics_port, engines, prom = free_port(), free_port(), [free_port(), free_port()], free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kubeinfer.cli", "local-stack", "--demo-dir", str(demo), "--port", str(port),
         "--metrics-port", str(metrics_port), "--engine-ports", ",".join(map(str, engines)), "--prometheus", str(prom)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        printed, deadline = [], time.time() + 120
        for line in process.stdout:
            printed.append(line)
            if "prometheus:" in line:
                break
            assert time.time() < deadline and "metrics:" not in "".join(printed[:-1]), "".join(printed)
        assert f"http://127.0.0.1:{prom}/graph" in printed[-1]
        scraped: dict = {}
        while time.time() < deadline and len(scraped) < 3:  # discovery hands out targets after about 5 s
            active = httpx.get(f"http://127.0.0.1:{prom}/api/v1/targets").json()["data"]["activeTargets"]
            scraped = {t["scrapeUrl"]: t["labels"]["job"] for t in active if t["health"] == "up"}
            time.sleep(0.5)
        assert sorted(scraped.values()) == ["kubeinfer-engine", "kubeinfer-engine", "kubeinfer-gateway"]
        rules = httpx.get(f"http://127.0.0.1:{prom}/api/v1/rules").json()["data"]["groups"]
        assert {g["name"] for g in rules} == {"kubeinfer-engine", "kubeinfer-gateway"}
    finally:
        process.send_signal(signal.SIGINT)
        try:
            assert process.wait(timeout=60) == 0
        finally:
            if process.poll() is None:
                process.kill()
    assert not _serving(prom)
