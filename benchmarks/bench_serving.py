"""Online serving: a real `kubeinfer serve` process on loopback, driven by concurrent streaming clients.

At each concurrency level C, C clients each send streaming completions back to back (closed loop) until
the level's requests are done. Measured at the client, as users see it: output tokens/s, time to first
token (TTFT), time per output token after the first (TPOT, vLLM's definition) and the gaps between
streamed chunks (ITL). Peer, in the same run: the offline engine (`LLM.generate`) on the highest level's
requests all at once, which is what the server could reach with no HTTP, SSE or client in the way.
Client and server share this machine's cores, so the client's own work is part of the figures.
Writes benchmarks/serving.png and a section of benchmarks/RESULTS.md.

    python benchmarks/bench_serving.py [--concurrency 1,2,4,8,16] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from tqdm import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from bench_throughput import MODEL_SHAPE  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402

HERE = Path(__file__).parent
PLOT = HERE / "serving.png"
MODEL_NAME = "bench"
MAX_MODEL_LEN = 512


@dataclass
class RequestResult:
    ttft: float
    e2e: float
    output_tokens: int
    chunk_gaps: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class LevelResult:
    concurrency: int
    wall: float
    requests: list[RequestResult]

    @property
    def throughput(self) -> float:
        return sum(r.output_tokens for r in self.requests) / self.wall

    def ttft(self, q: float) -> float:
        return percentile([r.ttft for r in self.requests], q)

    def itl(self, q: float) -> float:
        return percentile([g for r in self.requests for g in r.chunk_gaps], q)

    @property
    def tpot(self) -> float:
        return statistics.mean(r.tpot for r in self.requests if r.tpot is not None)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_model() -> Path:
    """The throughput benchmark's model shape with the project's test tokenizer, so the server streams
    text (and detokenizes, as in production); the vocabulary is the tokenizer's."""
    model_dir = Path(".cache/bench-llama-serving")
    if not (model_dir / "config.json").exists():
        shape = {**MODEL_SHAPE, "vocab_size": None}
        build_random_model(model_dir, "llama", tokenizer=True, initializer_range=0.02, **shape)
    return model_dir


def workload(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(64, 256))] for _ in range(count)]


class Server:
    """`kubeinfer serve` in a subprocess; its log goes to a file that is shown if it fails."""

    def __init__(self, model_dir: Path, max_num_seqs: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(".cache/bench-serving-server.log")
        self.command = [sys.executable, "-m", "kubeinfer.cli", "serve", str(model_dir), "--host", "127.0.0.1",
                        "--port", str(self.port), "--served-model-name", MODEL_NAME, "--max-num-seqs",
                        str(max_num_seqs), "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning"]

    def __enter__(self) -> "Server":
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise SystemExit(f"kubeinfer serve did not become healthy; its log:\n{self.log_path.read_text()[-3000:]}")

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # SIGTERM: drains (nothing is in flight by now) and exits 0
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> RequestResult:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    chunk_times: list[float] = []
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"server answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if payload.get("choices") and payload["choices"][0]["text"]:
                chunk_times.append(time.perf_counter())
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
    end = time.perf_counter()
    if not chunk_times or tokens != max_tokens:
        raise RuntimeError(f"expected {max_tokens} streamed tokens, got {tokens} in {len(chunk_times)} chunks")
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    return RequestResult(ttft=chunk_times[0] - start, e2e=end - start, output_tokens=tokens, chunk_gaps=gaps)


async def run_level(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                    deadline_s: float, bar: tqdm) -> LevelResult:
    """`concurrency` clients in a closed loop over `prompts`; no new request starts after `deadline_s`."""
    queue = list(reversed(prompts))
    results: list[RequestResult] = []
    start = time.perf_counter()

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue and time.perf_counter() - start < deadline_s:
            results.append(await one_request(client, url, queue.pop(), max_tokens))
            bar.update(1)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return LevelResult(concurrency, time.perf_counter() - start, results)


def offline_peer(model_dir: Path, prompts: list[list[int]], max_tokens: int, max_num_seqs: int) -> float:
    """Output tokens/s of the offline engine on the same requests, submitted all at once."""
    from kubeinfer.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def plot(levels: list[LevelResult], offline: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [level.concurrency for level in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(xs, [level.throughput for level in levels], "o-", label="kubeinfer serve (HTTP, SSE)")
    left.axhline(offline, linestyle="--", color="grey", label="offline engine, same requests")
    left.set(xlabel="concurrent streaming clients", ylabel="output tokens / s", title="Throughput")
    right.plot(xs, [level.ttft(50) * 1e3 for level in levels], "o-", label="TTFT p50")
    right.plot(xs, [level.ttft(95) * 1e3 for level in levels], "o--", label="TTFT p95")
    right.plot(xs, [level.tpot * 1e3 for level in levels], "s-", label="TPOT mean")
    right.plot(xs, [level.itl(95) * 1e3 for level in levels], "s--", label="ITL p95")
    right.set(xlabel="concurrent streaming clients", ylabel="milliseconds", title="Latency", yscale="log")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(xs, [str(x) for x in xs])
        axis.grid(True, alpha=0.3)
        axis.legend()
    fig.suptitle(f"kubeinfer serve on {os.cpu_count()} CPU cores: random-init Llama "
                 f"({MODEL_SHAPE['num_layers']} layers, hidden {MODEL_SHAPE['hidden_size']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="client counts, comma-separated")
    parser.add_argument("--requests", type=int, default=None, help="requests per level (default: 2 x C, at least 8)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--level-seconds", type=float, default=40.0, help="no new request starts after this")
    args = parser.parse_args()
    levels_wanted = [int(c) for c in args.concurrency.split(",")]
    torch.manual_seed(0)

    model_dir = bench_model()
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    total = sum(args.requests or max(8, 2 * c) for c in levels_wanted)
    levels: list[LevelResult] = []
    with Server(model_dir, max_num_seqs=max(levels_wanted)) as server:
        asyncio.run(run_level(server.url, workload(2, vocab, seed=99), 2, args.max_tokens, 60,
                              tqdm(disable=True)))  # warm-up
        with tqdm(total=total, desc="streaming requests", unit="req", mininterval=0.5) as bar:
            for c in levels_wanted:
                bar.set_postfix(concurrency=c)
                prompts = workload(args.requests or max(8, 2 * c), vocab, seed=c)
                levels.append(asyncio.run(run_level(server.url, prompts, c, args.max_tokens, args.level_seconds, bar)))
    top = levels[-1]
    offline = offline_peer(model_dir, workload(len(top.requests), vocab, seed=top.concurrency),
                           args.max_tokens, top.concurrency)

    table = ["| clients | requests | output tok/s | vs 1 client | TTFT p50 (ms) | TTFT p95 (ms) | TPOT mean (ms) "
             "| ITL p50 (ms) | ITL p95 (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for level in levels:
        print(f"C={level.concurrency:3d}: {level.throughput:7.1f} tok/s, TTFT p50 {level.ttft(50) * 1e3:.0f} ms "
              f"p95 {level.ttft(95) * 1e3:.0f} ms, TPOT {level.tpot * 1e3:.1f} ms, "
              f"ITL p95 {level.itl(95) * 1e3:.1f} ms")
        table.append(f"| {level.concurrency} | {len(level.requests)} | {level.throughput:.1f} "
                     f"| {level.throughput / levels[0].throughput:.2f}x | {level.ttft(50) * 1e3:.0f} "
                     f"| {level.ttft(95) * 1e3:.0f} | {level.tpot * 1e3:.1f} | {level.itl(50) * 1e3:.1f} "
                     f"| {level.itl(95) * 1e3:.1f} |")
    print(f"offline engine on the C={top.concurrency} requests: {offline:.1f} tok/s")
    plot(levels, offline, PLOT)
    print(f"wrote {PLOT}")
    body = "\n".join([
        f"Command: `python benchmarks/bench_serving.py --concurrency {args.concurrency} "
        f"--max-tokens {args.max_tokens}`. "
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared by server and client), torch "
        f"{torch.__version__}, float32.",
        f"Server: `kubeinfer serve` (a subprocess on loopback, --max-num-seqs {max(levels_wanted)}) on the throughput "
        f"benchmark's model shape with the test tokenizer ({vocab}-token vocabulary). Each request: a 64-256 token "
        f"prompt, {args.max_tokens} output tokens (ignore_eos), greedy, streamed; C clients send back to back. TTFT: "
        "request sent to first text chunk; TPOT: (end - TTFT) / (tokens - 1); ITL: gaps between streamed chunks.",
        "", *table, "",
        f"Peer: the offline engine on the same {len(top.requests)} requests of the C={top.concurrency} level, "
        f"submitted at once: {offline:.1f} tok/s; the server at C={top.concurrency} reaches "
        f"{top.throughput / offline:.0%} of it "
        f"(HTTP, SSE and the client share the cores). Batching gain from 1 to {top.concurrency} clients: "
        f"{top.throughput / levels[0].throughput:.2f}x.",
        "", "![throughput and latency against concurrency](serving.png)"])
    update_results("serving", "Online serving: throughput and latency against concurrency (CPU)", body)


if __name__ == "__main__":
    main()
