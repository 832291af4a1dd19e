"""Batched multi-LoRA delta: our grouped-by-slot path vs two other ways to compute it, same inputs.

Peers, on the pool's own stacked tensors: a per-token gather of each token's A and B followed by
bmm (punica's BGMV shape, written in torch), and one dense matmul over every slot with the
non-matching slots masked out per token (no gather at all, but max_loras x the shrink work, at
max_lora_rank). Shapes are a 7B-class o_proj (4096 -> 4096) with max_lora_rank 64 and 4 adapters
of rank 16; the base matmul is timed too, for scale.

    python benchmarks/bench_lora_delta.py [--write]   # --write updates benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from results import update_results  # noqa: E402

from kubeinfer.engine.lora.adapter import LoRAAdapter, LoRAWeights  # noqa: E402
from kubeinfer.engine.lora.layers import LoRAContext  # noqa: E402
from kubeinfer.engine.lora.pool import LoRAPool  # noqa: E402

SPEC = SimpleNamespace(hidden_size=4096, num_layers=1, num_heads=32, num_kv_heads=8, head_dim=128,
                       intermediate_size=11008)
MAX_LORAS, MAX_RANK, RANK, MODULE = 4, 64, 16, "o_proj"


def build_pool() -> LoRAPool:
    pool = LoRAPool(SPEC, max_loras=MAX_LORAS, max_lora_rank=MAX_RANK)
    for i in range(1, MAX_LORAS + 1):
        a, b = 0.01 * torch.randn(RANK, 4096), 0.01 * torch.randn(4096, RANK)
        pool.add(LoRAAdapter(f"a{i}", i, RANK, 1.0, {(0, MODULE): LoRAWeights(a, b)}))
        pool.acquire(i)
    return pool


def gather_bmm(pool: LoRAPool, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    a, b = pool.lora_a[0][MODULE][slots], pool.lora_b[0][MODULE][slots]  # [T, R, in], [T, out, R]
    return torch.bmm(b, torch.bmm(a, x.unsqueeze(-1))).squeeze(-1)


def masked_dense(a_flat: torch.Tensor, b_flat: torch.Tensor, mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return ((x @ a_flat.T) * mask) @ b_flat.T


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    pool = build_pool()
    slots_total = MAX_LORAS + 1
    a_flat = pool.lora_a[0][MODULE].reshape(slots_total * MAX_RANK, -1)
    b_flat = pool.lora_b[0][MODULE].permute(1, 0, 2).reshape(-1, slots_total * MAX_RANK).contiguous()
    weight = 0.01 * torch.randn(4096, 4096)
    rows = ["| tokens | routing | base matmul ms | ours (grouped) ms | masked dense ms | gather + bmm ms |",
            "|---:|---|---:|---:|---:|---:|"]
    for tokens in (1, 16, 256, 2048):
        x = torch.randn(tokens, 4096)
        for routing in ("interleaved", "runs"):
            slots = (torch.arange(tokens) + 1) % slots_total  # every fifth token on the base model
            if routing == "runs":
                slots = slots.sort().values
            ctx = LoRAContext.build(pool, slots)
            mask = torch.zeros(tokens, slots_total, MAX_RANK)
            mask[torch.arange(tokens), slots] = 1.0
            mask = mask.reshape(tokens, -1)
            ours = ctx.delta(x, 0, MODULE) if ctx else torch.zeros(tokens, 4096)
            torch.testing.assert_close(ours, masked_dense(a_flat, b_flat, mask, x), atol=1e-4, rtol=1e-3)
            repeats = max(3, 1024 // tokens)
            base = timed(lambda: x @ weight.T, repeats)
            grouped = timed(lambda: ctx.apply(torch.zeros(tokens, 4096), x, 0, MODULE) if ctx else None, repeats)
            dense = timed(lambda: masked_dense(a_flat, b_flat, mask, x), repeats)
            gather = timed(lambda: gather_bmm(pool, x, slots), repeats) if tokens <= 256 else float("nan")
            rows.append(f"| {tokens} | {routing} | {base:.2f} | {grouped:.2f} | {dense:.2f} | {gather:.2f} |")
    table = "\n".join(rows)
    print(table)
    if args.write:
        body = (f"`python benchmarks/bench_lora_delta.py --write` on {platform.processor() or platform.machine()}, "
                f"{torch.get_num_threads()} threads, fp32. {MAX_LORAS} adapters of rank {RANK} in a pool with "
                f"max_lora_rank {MAX_RANK}, {MODULE} 4096 -> 4096; gather + bmm skipped at 2048 tokens "
                f"(it materialises [T, 4096, {MAX_RANK}]).\n\n{table}\n")
        update_results("lora-delta", "Batched LoRA delta on the CPU", body)


if __name__ == "__main__":
    main()
