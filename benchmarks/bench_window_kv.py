"""KV-cache memory held by long requests on a Gemma-3-shaped model (5 sliding-window layers : 1 global), with
and without freeing the windowed layers' blocks that fall out of every window (core/window_blocks.py), and
how many such requests run at once in the same KV memory.

"Without freeing" is the single pool every other model uses (each block holds a slice of every layer),
obtained here by not giving the windowed layers a pool of their own. Memory is counted in all-layer block
equivalents: a full-layer block is 2/12 of one, a windowed-layer block 10/12.

    python benchmarks/bench_window_kv.py [--tokens 4096] [--window 512] [--blocks 1024] [--requests 16]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from results import update_results  # noqa: E402

from kubeinfer.engine import LLM, SamplingParams  # noqa: E402
from kubeinfer.engine.model_executor.model_runner import ModelRunner  # noqa: E402
from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402

LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 2  # Gemma 3's 5:1 pattern, 12 layers
BLOCK_SIZE = 16
FULL_SHARE = LAYER_TYPES.count("full_attention") / len(LAYER_TYPES)


def held(llm: LLM) -> float:
    """KV memory held by live sequences, in all-layer block equivalents."""
    bm = llm.engine.block_manager
    if not hasattr(bm, "windowed"):
        return bm.num_blocks - bm.num_free_blocks
    window_held = bm.windowed.num_blocks - 1 - bm.windowed.num_free_blocks
    return FULL_SHARE * (bm.num_blocks - bm.num_free_blocks) + (1 - FULL_SHARE) * window_held


def run(llm: LLM, tokens: int, count: int, max_tokens: int) -> tuple[float, int, int]:
    """(most memory held, most requests running at once, preemptions) while `count` requests run."""
    engine = llm.engine
    for r in range(count):
        engine.add_request(f"r{r}", {"prompt_token_ids": [5 + (i * (r + 3)) % 400 for i in range(tokens)]},
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    most_held, most_running = 0.0, 0
    while engine.has_unfinished_requests():
        engine.step()
        most_held, most_running = max(most_held, held(llm)), max(most_running, len(engine.scheduler.running))
    return most_held, most_running, engine.scheduler.num_preemptions


def measure(path: Path, tokens: int, requests: int, kv_bytes: int, freeing: bool) -> tuple[float, int, int]:
    def make() -> LLM:
        return LLM(str(path), block_size=BLOCK_SIZE, kv_cache_memory_bytes=kv_bytes, max_num_seqs=requests,
                   max_num_batched_tokens=1024, max_model_len=2 * tokens)
    single_pool = mock.patch.object(ModelRunner, "window_group", staticmethod(lambda spec: None))
    with contextlib.nullcontext() if freeing else single_pool:
        one, _, _ = run(make(), tokens, 1, 16)
        # Long-lived requests (256 tokens each), so that memory, not the step budget, bounds how many run at once
        _, running, preemptions = run(make(), tokens, requests, 256)
    return one, running, preemptions


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=1024, help="KV memory, in all-layer blocks")
    parser.add_argument("--requests", type=int, default=16)
    args = parser.parse_args()
    path = Path(f".cache/bench-gemma3-window{args.window}")
    if not (path / "config.json").exists():
        build_random_model(path, "gemma3", tokenizer=False, num_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES,
                           sliding_window=args.window, max_position_embeddings=2 * args.tokens)
    probe = LLM(str(path), block_size=BLOCK_SIZE, num_kv_blocks=1).engine
    kv_bytes = args.blocks * ModelRunner.kv_bytes_per_block(probe.spec, BLOCK_SIZE, probe.dtype)
    results = {freeing: measure(path, args.tokens, args.requests, kv_bytes, freeing) for freeing in (False, True)}
    rows = ["| | without freeing | with freeing |", "|---|---|---|",
            f"| KV held by one {args.tokens}-token request (all-layer blocks) | {results[False][0]:.0f} | "
            f"{results[True][0]:.1f} |",
            f"| requests running at once ({args.requests} submitted, KV memory of {args.blocks} all-layer blocks) | "
            f"{results[False][1]} ({results[False][2]} preemptions) | {results[True][1]} ({results[True][2]} preemptions) |"]
    body = (f"Command: `python benchmarks/bench_window_kv.py --tokens {args.tokens} --window {args.window} "
            f"--blocks {args.blocks} --requests {args.requests}`. Model: Gemma 3's layer pattern (5 sliding-window "
            f"layers : 1 global, 12 layers, hidden 64), sliding_window {args.window}, {BLOCK_SIZE}-token blocks, "
            f"CPU float32, max_num_seqs {args.requests}, 1,024-token steps, 256 tokens generated per request. "
            "With freeing, the windowed layers have "
            "their own pool (core/window_blocks.py), sized for max_num_seqs sequences' windows and capped at half "
            "the KV memory; the full layers get the rest. Memory in all-layer block equivalents (a full-layer block "
            "is 2/12 of one, a windowed-layer block 10/12); the peak over the request's steps.\n\n" + "\n".join(rows))
    print(body)
    update_results("window-kv", "Sliding-window KV blocks freed on a Gemma-3-shaped model (issue 28)", body)


if __name__ == "__main__":
    main()
