"""`kubeinfer local-stack` (what `make run` runs): the whole serving path on this machine.

Builds (or reuses) the demo model and its LoRA adapters, starts two engine replicas with the adapters
placed on different replicas, and the gateway in front of them on http://127.0.0.1:8080, then prints
what to try. Ctrl-C, or SIGINT or SIGTERM sent to this process alone, stops everything: the gateway
first, then the engines, which drain.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kubeinfer.dev.local_scaler import LocalScaler, Replica

DEFAULT_DEMO_DIR = Path(".cache/demo-model")
SERVED_NAME = "demo"
QUESTION = "Tell me something."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--demo-dir", type=Path, default=DEFAULT_DEMO_DIR, help="where the demo model is (built if missing)")
    parser.add_argument("--port", type=int, default=8080, help="gateway port")
    parser.add_argument("--engine-ports", default="8001,8002", help="the two engine replicas' ports")
    parser.add_argument("--metrics-port", type=int, default=9090, help="gateway metrics port")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--scale-to-zero", type=float, default=None, metavar="SECONDS",
                        help="stop an engine replica idle for SECONDS and start it again when the gateway holds a "
                             "request for it (watch kubeinfer_gateway_requests_held on the gateway's metrics)")
    parser.add_argument("--prometheus", nargs="?", type=int, const=9091, default=None, metavar="PORT",
                        help="also start a Prometheus (the `prometheus` binary, e.g. Debian's package) on PORT "
                             "(default 9091) scraping the gateway and the engines with the chart's scrape "
                             "configuration and loading the alert rules; prints where to graph the dashboard's queries")
    parser.add_argument("--speculative", nargs="?", const="draft", choices=("draft", "ngram"), default=None,
                        help="engines decode speculatively (--speculative-config): with the demo's draft model "
                             "(the default), or n-gram")


NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def speculative_config(kind: str, demo: Path) -> str:
    """The engines' --speculative-config for `--speculative KIND`."""
    config = NGRAM_CONFIG if kind == "ngram" else {"model": str(demo / "draft"), "num_speculative_tokens": 4}
    return json.dumps(config)


def placements(adapters: list[Path], replicas: int) -> list[list[Path]]:
    """Adapters spread round-robin over replicas, so each replica holds different ones."""
    return [adapters[i::replicas] for i in range(replicas)]


def wait_healthy(url: str, process: subprocess.Popen, deadline: float) -> bool:
    """Poll url/health until it answers 200 (True), or the process exits or the monotonic deadline passes
    (False)."""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    return False


def _wait_ready(url: str, process: subprocess.Popen, timeout: float) -> None:
    if wait_healthy(url, process, time.monotonic() + timeout):
        return
    if process.poll() is not None:
        raise SystemExit(f"local-stack: {url} exited with code {process.returncode}; see its log above")
    raise SystemExit(f"local-stack: {url} did not become ready within {timeout:.0f} s")


def start_prometheus(port: int, metrics_port: int, engine_urls: list[str], directory: Path):
    """A LocalPrometheus scraping this stack every 5 s, or None (with the reason printed) without the binary."""
    from kubeinfer.dev.prometheus_local import LocalPrometheus, Target, binary, config

    if binary() is None:
        print("local-stack: --prometheus: no `prometheus` binary on PATH (Debian/Ubuntu: apt-get install prometheus); "
              "going on without it", file=sys.stderr, flush=True)
        return None
    engines = [Target(url.removeprefix("http://"), "local", f"engine-{i}",
                      {"serving.kubeinfer.io/inference-model": SERVED_NAME}) for i, url in enumerate(engine_urls)]
    gateway = [Target(f"127.0.0.1:{metrics_port}", "local", "gateway")]
    return LocalPrometheus(config(gateway, engines, interval="5s"), directory, port).start()


def _instructions(port: int, metrics_port: int, engine_urls: list[str], adapters: list[str],
                  prometheus_url: str | None = None) -> str:
    url = f"http://127.0.0.1:{port}"
    lines = [
        "", f"kubeinfer is serving on {url}  (Ctrl-C stops everything)", "",
        f"  models:   curl -s {url}/v1/models", "",
    ]
    for model in [SERVED_NAME, *adapters]:  # same question, three styles: the adapter changes the answer
        lines += [f"  {model}:", f"    curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\",
                  f"      -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", "
                  f"\"content\": \"{QUESTION}\"}}], \"max_tokens\": 60, \"temperature\": 0}}'", ""]
    lines += [
        "  with the openai client:",
        "    .venv/bin/python - <<'EOF'",
        "    from openai import OpenAI",
        f"    client = OpenAI(base_url='{url}/v1', api_key='unused')",
        f"    for model in {[SERVED_NAME, *adapters]!r}:",
        "        out = client.chat.completions.create(model=model, max_tokens=60, temperature=0,",
        f"                                             messages=[{{'role': 'user', 'content': '{QUESTION}'}}])",
        "        print(model, '->', out.choices[0].message.content)",
        "    EOF", "",
        f"  metrics:  gateway http://127.0.0.1:{metrics_port}/metrics, engines "
        + ", ".join(u + "/metrics" for u in engine_urls), ""]
    if prometheus_url:
        lines[-1:] = [(f"  prometheus: {prometheus_url}/graph  (the queries of manifests/dashboards/kubeinfer.json, "
                       "e.g. sum(rate(vllm:generation_tokens_total[1m])); alerts at "
                       f"{prometheus_url}/alerts)"), ""]
    return "\n".join(lines)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def handle_stop_signals() -> None:
    """SIGINT and SIGTERM stop the stack, however it was started. Why explicit: a process started in the
    background by a non-interactive shell (`kubeinfer local-stack &`, a CI script) inherits SIGINT
    ignored, and Python then installs no handler of its own: a lone SIGINT did nothing."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)


def run(args: argparse.Namespace) -> int:
    from kubeinfer.dev.demo_model import build_demo_model

    handle_stop_signals()
    demo = build_demo_model(args.demo_dir)
    adapters = sorted(p for p in (demo / "adapters").iterdir() if (p / "adapter_config.json").is_file())
    ports = [int(p) for p in args.engine_ports.split(",")]
    kubeinfer = [sys.executable, "-m", "kubeinfer.cli"]
    # One thread per engine: two engines and the gateway share the cores, and oversubscribed torch
    # threads are several times slower than one each.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    processes: list[subprocess.Popen] = []
    replicas: list[Replica] = []
    stoppers: list = []  # what else to stop first (a Prometheus)

    def stop_all(*_) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        for stop in stoppers:
            stop()
        for process in reversed(processes):  # gateway first, then engines (they drain)
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in reversed(processes):
            try:
                process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                process.kill()

    try:
        engine_urls = []
        for port, placed in zip(ports, placements(adapters, len(ports))):
            modules = [f"{a.name}={a}" for a in placed]
            command = [*kubeinfer, "serve", str(demo / "base"), "--host", "127.0.0.1", "--port", str(port),
                       "--served-model-name", SERVED_NAME, "--max-num-seqs", "16", "--log-level", "warning",
                       "--scheduling-policy", "priority"]
            if modules:
                command += ["--lora-modules", *modules, "--max-lora-rank", "64", "--max-loras", str(len(modules))]
            if args.speculative:
                command += ["--speculative-config", speculative_config(args.speculative, demo)]
            replicas.append(Replica(f"http://127.0.0.1:{port}", command, env))
            replicas[-1].start()
            processes.append(replicas[-1].process)
            engine_urls.append(replicas[-1].url)
        for url, process in zip(engine_urls, processes):
            _wait_ready(url, process, args.ready_timeout)
        processes.append(subprocess.Popen([*kubeinfer, "gateway", "--host", "127.0.0.1", "--port", str(args.port),
                                           "--ext-proc-port", "0", "--metrics-port", str(args.metrics_port),
                                           "--endpoints", ",".join(engine_urls), "--log-level", "warning",
                                           "--forward-priority"], env=env))
        _wait_ready(f"http://127.0.0.1:{args.port}", processes[-1], 60)
        prometheus = None
        if args.prometheus is not None:
            data = Path(tempfile.mkdtemp(prefix="kubeinfer-prometheus-"))
            stoppers.append(lambda: shutil.rmtree(data, ignore_errors=True))
            prometheus = start_prometheus(args.prometheus, args.metrics_port, engine_urls, data)
            if prometheus is not None:
                stoppers.insert(0, prometheus.stop)
        print(_instructions(args.port, args.metrics_port, engine_urls, [a.name for a in adapters],
                            prometheus.url if prometheus else None), flush=True)
        scaler = (LocalScaler(replicas, f"http://127.0.0.1:{args.metrics_port}/metrics", args.scale_to_zero)
                  if args.scale_to_zero is not None else None)
        while processes[-1].poll() is None and all(r.running for r in replicas
                                                   if scaler is None or r not in scaler.stopped):
            if scaler is not None:
                scaler.tick()
                processes[:-1] = [r.process for r in replicas]  # restarted replicas are new processes
            time.sleep(0.5)
        print("local-stack: a component exited; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nlocal-stack: stopping", flush=True)
        return 0
    finally:
        stop_all()
