"""TTFT of multi-turn conversations whose KV outgrows the device cache: the native CPU tier
(`--kv-offloading-size`) against no tier, same engine build, same requests, same run.

Each conversation starts with a long system/context prompt; every turn appends the previous answer and a new
user message, so a turn's prompt is the whole history. Turns of all conversations arrive in round-robin (the
others' turns are the think time), one request at a time, so TTFT is prefill time without queueing. In the
"pressure" scenario the conversations' total KV is about 3x the device cache: by the time a conversation
comes back, its history was evicted; without a tier it is recomputed, with the tier it is loaded back. In the
"fits" scenario the device cache holds everything (the tier must cost nothing). The engines with and without
the tier take turns request by request, so background load hits both alike; greedy outputs are compared.

    python benchmarks/bench_kv_offload.py [--conversations 8] [--turns 4] [--context 256] [--pressure 3]
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from bench_throughput import MODEL_SHAPE  # noqa: E402

from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402
from kubeinfer.engine import LLM, SamplingParams  # noqa: E402

BLOCK_SIZE = 16
USER_TOKENS = 48
MAX_TOKENS = 8


def cpu_flags() -> str:
    """The SIMD flags that decide the CPU kernels' speed (from /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    wanted = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4_2"))]
    return " ".join(sorted(wanted)) or "none of avx/amx/fma"


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    return output.metrics["first_token_time"] - output.metrics["arrival_time"], output.outputs[0].token_ids


def run_scenario(model_dir: str, args, device_blocks: int, tier_gib: float) -> dict:
    engines = {tier: LLM(model_dir, block_size=BLOCK_SIZE, num_kv_blocks=device_blocks, max_num_seqs=4,
                         **({"kv_offloading_size": tier_gib} if tier else {})) for tier in (True, False)}
    for llm in engines.values():  # warm-up on an unrelated prompt: kernels, not the cache
        ttft(llm, list(range(20, 84)))
    rng = random.Random(0)
    vocab = MODEL_SHAPE["vocab_size"]
    histories = {tier: [[rng.randrange(10, vocab) for _ in range(args.context)] for _ in range(args.conversations)]
                 for tier in (True,)}
    histories[False] = [list(h) for h in histories[True]]
    times: dict = {True: [], False: [], "same": 0, "requests": 0}
    for turn in range(args.turns):
        for conv in range(args.conversations):
            user = [rng.randrange(10, vocab) for _ in range(USER_TOKENS)]
            answers = {}
            for tier, llm in engines.items():
                histories[tier][conv] += user
                seconds, answers[tier] = ttft(llm, histories[tier][conv])
                histories[tier][conv] += answers[tier]  # each engine's own answer: a divergence shows in "same"
                if turn > 0:  # first turns fill the caches: both engines prefill everything
                    times[tier].append(seconds)
            times["same"] += answers[True] == answers[False]
            times["requests"] += 1
    times["stats"] = engines[True].engine.kv_transfer.connector.stats
    return times


def transfer_throughput(blocks: int = 128, repeats: int = 5) -> str:
    """The tier's block copies (the model's cache shape) against a plain memory copy of the same bytes, same run
    (32 MiB by default: past the caches, as a step's transfers of a long prompt are)."""
    import time

    from kubeinfer.engine.core.block_manager import BlockManager
    from kubeinfer.engine.kv_transfer.config import KVTransferConfig
    from kubeinfer.engine.kv_transfer.offloading import OffloadingConnector

    layers, heads = MODEL_SHAPE["num_layers"], MODEL_SHAPE["num_kv_heads"]
    head_dim = MODEL_SHAPE["hidden_size"] // MODEL_SHAPE["num_heads"]
    config = KVTransferConfig("OffloadingConnector", kv_connector_extra_config={"num_cpu_blocks": blocks})
    connector = OffloadingConnector(config, BLOCK_SIZE, num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                                    cache_dtype=torch.float32, device=torch.device("cpu"),
                                    block_key=BlockManager.block_key)
    shape = (2 * blocks, BLOCK_SIZE, heads, head_dim)
    connector.register_kv_caches([(torch.randn(shape), torch.randn(shape)) for _ in range(layers)])
    ids, slots = list(range(0, 2 * blocks, 2)), list(range(blocks))
    nbytes = blocks * connector.pool.slot_bytes
    source, target = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return nbytes / min(times) / 1e9
    save, load = best(lambda: connector._write_blocks(ids, slots)), best(lambda: connector._read_blocks(ids, slots))
    copy = best(lambda: target.copy_(source))
    return (f"{blocks} blocks of {connector.pool.slot_bytes // 1024} KiB: save {save:.2f} GB/s, load {load:.2f} GB/s, "
            f"memcpy {copy:.2f} GB/s (save {save / copy:.0%}, load {load / copy:.0%} of it)")


def summary(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    return statistics.mean(ordered), ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--context", type=int, default=256, help="tokens of each conversation's first prompt")
    parser.add_argument("--pressure", type=float, default=3.0, help="total KV / device cache in the pressure run")
    args = parser.parse_args()
    final_len = args.context + args.turns * (USER_TOKENS + MAX_TOKENS)
    if final_len > MODEL_SHAPE["max_position_embeddings"]:
        raise SystemExit(f"a conversation would reach {final_len} tokens, past the model's context")
    torch.manual_seed(0)
    model_dir = Path(".cache/bench-llama-33m")  # the model of bench_throughput.py, built the same way
    if not (model_dir / "config.json").exists():
        build_random_model(model_dir, "llama", tokenizer=False, initializer_range=0.02, **MODEL_SHAPE)
    total_blocks = args.conversations * -(-final_len // BLOCK_SIZE)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; CPU flags: {cpu_flags()}")
    print(f"{args.conversations} conversations x {args.turns} turns, {args.context}-token context, "
          f"+{USER_TOKENS} user / {MAX_TOKENS} answer tokens a turn: {total_blocks} KV blocks of {BLOCK_SIZE} in all")
    print("transfers (best of 5):", transfer_throughput())
    scenarios = {"pressure": max(8, int(total_blocks / args.pressure)), "fits": total_blocks * 2}
    for name, device_blocks in scenarios.items():
        times = run_scenario(str(model_dir), args, device_blocks, tier_gib=1.0)
        off, on = summary(times[False]), summary(times[True])
        stats = times["stats"]
        print(f"[{name}] device cache {device_blocks} blocks ({total_blocks / device_blocks:.1f}x less than the KV), "
              f"turns 2..{args.turns}:")
        print(f"  TTFT without tier: mean {off[0] * 1e3:7.1f} ms, p50 {off[1] * 1e3:7.1f}, p90 {off[2] * 1e3:7.1f}")
        print(f"  TTFT with CPU tier: mean {on[0] * 1e3:7.1f} ms, p50 {on[1] * 1e3:7.1f}, p90 {on[2] * 1e3:7.1f}"
              f"  -> mean {off[0] / on[0]:.2f}x")
        print(f"  tier: {stats.hits} prompt tokens loaded ({stats.bytes_loaded / 2**20:.1f} MiB in "
              f"{stats.seconds_loading * 1e3:.1f} ms), {stats.bytes_saved / 2**20:.1f} MiB saved in "
              f"{stats.seconds_saving * 1e3:.1f} ms; identical outputs {times['same']}/{times['requests']}")


if __name__ == "__main__":
    main()
