"""Does /health stay fast while long prompts arrive? The engine tokenizes and renders chat templates on
its own threads, never on the event loop; this measures /health's latency (p50, p99, max) from a
`kubeinfer serve` process while clients send long prompts (each is tokenized, then refused as longer
than the context: all tokenizer work, no model work), against the same probe on an idle server.

    python benchmarks/bench_health_under_load.py [--senders 4] [--prompt-chars 200000] [--seconds 10]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from results import update_results  # noqa: E402

from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe(url: str, seconds: float) -> list[float]:
    latencies, deadline = [], time.monotonic() + seconds
    with httpx.Client(timeout=10) as client:
        while time.monotonic() < deadline:
            start = time.perf_counter()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.01)
    return latencies


def send_long_prompts(url: str, text: str, stop: threading.Event, sent: list[int]) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            response = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": text, "max_tokens": 1})
            assert response.status_code == 400, response.text  # longer than the context: refused after tokenizing
            sent.append(1)


def summary(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return (f"p50 {statistics.median(ordered) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {ordered[-1] * 1e3:.1f} ms "
            f"({len(ordered)} probes)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--prompt-chars", type=int, default=200_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    model = build_random_model(tempfile.mkdtemp(), "llama")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "kubeinfer.cli", "serve", str(model), "--host", "127.0.0.1",
                               "--port", str(port), "--served-model-name", "tiny", "--log-level", "warning",
                               # let these prompts reach the tokenizer (by default they are over the character
                               # bound, refused before any tokenizing): the load measured is tokenizer work
                               "--max-prompt-chars", str(args.prompt_chars)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        idle = probe(url, args.seconds / 2)
        text = ("The licensee may copy and distribute the work. " * (args.prompt_chars // 48 + 1))[:args.prompt_chars]
        stop, sent = threading.Event(), []
        senders = [threading.Thread(target=send_long_prompts, args=(url, text, stop, sent)) for _ in range(args.senders)]
        for thread in senders:
            thread.start()
        loaded = probe(url, args.seconds)
        stop.set()
        for thread in senders:
            thread.join()
    finally:
        server.terminate()
        server.wait(30)
    print("idle:  ", summary(idle))
    print("loaded:", summary(loaded), f"while {len(sent)} prompts of {args.prompt_chars} characters were tokenized")
    body = (f"`kubeinfer serve` on a tiny random Llama; /health probed every 10 ms for {args.seconds:g} s while "
            f"{args.senders} clients send prompts of {args.prompt_chars:,} characters back to back (each is "
            "tokenized on the server's tokenizer threads, then refused as longer than the context).\n\n"
            f"| server | /health latency |\n|---|---|\n| idle | {summary(idle)} |\n"
            f"| {len(sent)} long prompts tokenized | {summary(loaded)} |\n\n"
            "Command: `python benchmarks/bench_health_under_load.py`.")
    update_results("health-under-load", "/health latency while long prompts are tokenized (CPU)", body)


if __name__ == "__main__":
    main()
