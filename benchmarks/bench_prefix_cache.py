"""Time to first token with a long shared prompt prefix: prefix caching on vs off, same engine, same requests.

The workload is the common one: a long system prompt shared by every request, then a short question of
its own. With prefix caching the engine finds the shared prefix's KV blocks (hashed by content) and
prefills only the rest; without it, every request prefills everything. Requests go one at a time, so
TTFT is prefill time with no queueing, and the two engines take turns request by request, so background
load hits both alike. The first request of each prefix length fills the cache: it is reported apart.
Results go to benchmarks/RESULTS.md.

    python benchmarks/bench_prefix_cache.py [--prefixes 256,512,896] [--requests 12]
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from bench_throughput import MODEL_SHAPE  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.engine import LLM, SamplingParams  # noqa: E402
from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402

SUFFIX_TOKENS = (8, 48)  # each request's own part
MAX_TOKENS = 4


def requests_for(prefix_len: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = MODEL_SHAPE["vocab_size"]
    prefix = [rng.randrange(10, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(10, vocab) for _ in range(rng.randint(*SUFFIX_TOKENS))] for _ in range(count)]


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int, list[int]]:
    """(seconds to the first token, prompt tokens found in the cache, greedy output) of one request."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    metrics = output.metrics
    return metrics["first_token_time"] - metrics["arrival_time"], output.num_cached_tokens, output.outputs[0].token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefixes", default="256,512,896", help="shared prefix lengths in tokens, comma-separated")
    parser.add_argument("--requests", type=int, default=12, help="requests per prefix length")
    args = parser.parse_args()
    prefixes = [int(p) for p in args.prefixes.split(",")]
    if max(prefixes) + SUFFIX_TOKENS[1] + MAX_TOKENS > MODEL_SHAPE["max_position_embeddings"]:
        raise SystemExit(f"--prefixes: the longest prefix must leave room for {SUFFIX_TOKENS[1] + MAX_TOKENS} "
                         f"more tokens in the model's {MODEL_SHAPE['max_position_embeddings']}-token context")
    torch.manual_seed(0)

    model_dir = Path(".cache/bench-llama-33m")  # the model of bench_throughput.py, built the same way
    if not (model_dir / "config.json").exists():
        build_random_model(model_dir, "llama", tokenizer=False, initializer_range=0.02, **MODEL_SHAPE)
    engines = {on: LLM(str(model_dir), max_num_seqs=4, num_kv_blocks=512, enable_prefix_caching=on)
               for on in (True, False)}
    for llm in engines.values():  # warm-up on an unrelated prompt: kernels, not the cache
        ttft(llm, requests_for(64, 1, seed=999)[0])

    results = {}  # prefix length -> {on: [(ttft, share of the prompt from cache)], "same": equal outputs}
    bar = tqdm(total=2 * args.requests * len(prefixes), desc="requests (cache on / off, in turns)", mininterval=0.5)
    with bar:
        for prefix_len in prefixes:
            runs: dict = {True: [], False: [], "same": 0}
            for prompt in requests_for(prefix_len, args.requests, seed=prefix_len):
                outputs = {}
                for on, llm in engines.items():
                    seconds, cached, outputs[on] = ttft(llm, prompt)
                    runs[on].append((seconds, cached / len(prompt)))
                    bar.update(1)
                runs["same"] += outputs[True] == outputs[False]
            results[prefix_len] = runs

    table = ["| shared prefix | prompt tokens | TTFT cache off (ms, median) | TTFT cache on (ms, median) | speed-up "
             "| first request, cache on (ms) | prompt tokens from cache | identical outputs |",
             "|---|---|---|---|---|---|---|---|"]
    for prefix_len, runs in results.items():
        off = statistics.median(s for s, _ in runs[False][1:])
        on = statistics.median(s for s, _ in runs[True][1:])
        cold = runs[True][0][0]
        mean_prompt = prefix_len + sum(SUFFIX_TOKENS) / 2
        hit = statistics.mean(share for _, share in runs[True][1:])
        print(f"prefix {prefix_len:4d}: TTFT off {off * 1e3:7.1f} ms, on {on * 1e3:7.1f} ms ({off / on:.1f}x), "
              f"first request on {cold * 1e3:.1f} ms, {hit:.0%} of prompt tokens from cache")
        table.append(f"| {prefix_len} | ~{mean_prompt:.0f} | {off * 1e3:.1f} | {on * 1e3:.1f} | {off / on:.2f}x "
                     f"| {cold * 1e3:.1f} | {hit:.0%} | {runs['same']}/{args.requests} |")
    body = "\n".join([
        f"Command: `python benchmarks/bench_prefix_cache.py --prefixes {args.prefixes} --requests {args.requests}`. "
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, float32.",
        f"Model: the random-init Llama of the throughput benchmark. Per prefix length, {args.requests} requests share "
        f"the prefix and add {SUFFIX_TOKENS[0]}-{SUFFIX_TOKENS[1]} tokens of their own, {MAX_TOKENS} output tokens, "
        "greedy, one at a time; two engines (prefix caching on / off) take turns on the same requests. Medians leave "
        "out the first request, which fills the cache; it is shown apart. Identical outputs: greedy tokens equal "
        "with and without the cache.",
        "", *table])
    update_results("prefix-cache-ttft", "TTFT with a shared prompt prefix, prefix cache on vs off (CPU)", body)


if __name__ == "__main__":
    main()
