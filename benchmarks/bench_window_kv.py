"""KV-cache blocks held by long requests on a Gemma-3-shaped model (5 sliding-window layers : 1 global), and
how many such requests run at once in one cache: what sliding-window block freeing (issue 28) would change.

Measured: blocks held by one request once its 4,096-token prompt is computed, and the most requests running
at once when 8 of them share a 1,024-block cache (the rest wait or are preempted). The engine does not yet
free the blocks of windowed layers that fall out of every window, so every layer holds every block; the
"with freeing" column is computed from the layer pattern (full layers keep all blocks, windowed layers the
blocks covering the last `sliding_window` tokens plus one), not measured.

    python benchmarks/bench_window_kv.py [--tokens 4096] [--window 512] [--blocks 1024]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from results import update_results  # noqa: E402

from kubeinfer.engine import LLM, SamplingParams  # noqa: E402
from kubeinfer.testing.random_model import build_random_model  # noqa: E402

LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 2  # Gemma 3's 5:1 pattern, 12 layers
BLOCK_SIZE = 16


def held_blocks(llm: LLM) -> int:
    bm = llm.engine.block_manager
    return bm.num_blocks - bm.num_free_blocks


def one_request(llm: LLM, tokens: int) -> int:
    engine = llm.engine
    engine.add_request("long", {"prompt_token_ids": [5 + i % 400 for i in range(tokens)]},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    held = 0
    while engine.has_unfinished_requests():
        engine.step()
        held = max(held, held_blocks(llm))
    return held


def concurrent(llm: LLM, tokens: int, count: int) -> tuple[int, int]:
    engine = llm.engine
    for r in range(count):
        engine.add_request(f"r{r}", {"prompt_token_ids": [5 + (i * (r + 3)) % 400 for i in range(tokens)]},
                           SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    return most, engine.scheduler.num_preemptions


def projected_blocks(tokens: int, window: int) -> float:
    """All-layer block equivalents a request would hold with windowed layers' out-of-window blocks freed."""
    full = LAYER_TYPES.count("full_attention") / len(LAYER_TYPES)
    per_window = min(-(-tokens // BLOCK_SIZE), -(-window // BLOCK_SIZE) + 1)
    return full * -(-tokens // BLOCK_SIZE) + (1 - full) * per_window


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    path = Path(f".cache/bench-gemma3-window{args.window}")
    if not (path / "config.json").exists():
        build_random_model(path, "gemma3", tokenizer=False, num_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES,
                           sliding_window=args.window, max_position_embeddings=2 * args.tokens)
    make = lambda: LLM(str(path), block_size=BLOCK_SIZE, num_kv_blocks=args.blocks,  # noqa: E731
                       max_num_batched_tokens=1024)
    held = one_request(make(), args.tokens)
    most, preemptions = concurrent(make(), args.tokens, args.requests)
    projected = projected_blocks(args.tokens, args.window)
    rows = [
        "| | without freeing (measured) | with freeing (projected) |",
        "|---|---|---|",
        f"| blocks held by one {args.tokens}-token request | {held} | {projected:.1f} |",
        f"| requests running at once ({args.requests} submitted, {args.blocks}-block cache) | {most} "
        f"({preemptions} preemptions) | {int(args.blocks // projected)} would fit (cache / blocks per request) |",
    ]
    body = (f"Command: `python benchmarks/bench_window_kv.py --tokens {args.tokens} --window {args.window} "
            f"--blocks {args.blocks}`. Model: Gemma 3 layer pattern (5 sliding-window layers : 1 global, 12 layers), "
            f"sliding_window {args.window}, block size {BLOCK_SIZE}; a block holds one {BLOCK_SIZE}-token slice of "
            "every layer. The engine attends only within the window on windowed layers (exact against "
            "transformers) but does not free their out-of-window blocks yet: every layer keeps every block. The "
            "projection counts what freeing would keep: full layers all blocks, windowed layers "
            f"ceil(window / {BLOCK_SIZE}) + 1 blocks, in all-layer block equivalents.\n\n" + "\n".join(rows))
    print(body)
    update_results("window-kv", "Sliding-window KV blocks on a Gemma-3-shaped model (issue 28)", body)


if __name__ == "__main__":
    main()
