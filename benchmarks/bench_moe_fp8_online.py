"""`--quantization fp8` on a float MoE checkpoint: the bytes the engine holds with its experts kept e4m3 (the
fused MoE kernel's layout, what CUDA runs; forced here with KUBEINFER_QUANT_KERNEL=triton, nothing is
multiplied at load) against the round trip into float stacks (the CPU default), and each load's peak of live
bytes (tests/load_peak.py) and wall time. A random Qwen3-MoE with Qwen3-30B-A3B's layer shape (hidden 2048,
experts of intermediate 768, top 8) but fewer experts and layers, so it fits this machine.

    python benchmarks/bench_moe_fp8_online.py [--experts 32] [--layers 1]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel forced without a GPU (none runs at load)
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from load_peak import LiveBytes, held_bytes  # noqa: E402

from kubeinfer.engine import LLM  # noqa: E402
from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402

MIB = 1 << 20


def measure(model_dir: str, kernel: str | None) -> dict:
    if kernel is None:
        os.environ.pop("KUBEINFER_QUANT_KERNEL", None)
    else:
        os.environ["KUBEINFER_QUANT_KERNEL"] = kernel
    start = time.perf_counter()
    with LiveBytes() as live:
        llm = LLM(model_dir, max_model_len=64, num_kv_blocks=4, quantization="fp8")
    seconds = time.perf_counter() - start
    model = llm.engine.runner.model
    experts = [p for m in model.experts_modules().values() for p in m.parameters() if p.device.type != "meta"]
    floats = sum(4 * (m.gate_up_proj.numel() + m.down_proj.numel()) for m in model.experts_modules().values())
    kernels = sorted(set(getattr(model, "expert_kernels", {}).values()))
    out = dict(held=held_bytes(model), experts=sum(p.numel() * p.element_size() for p in experts), peak=live.peak,
               seconds=seconds, float_experts=floats, kernels=kernels)
    llm.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--layers", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_random_model(Path(tmp) / "qwen3_moe", "qwen3_moe", tokenizer=False, seed=1,
                                           hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                           num_experts=args.experts, num_experts_per_tok=8, num_heads=32,
                                           num_kv_heads=4, num_layers=args.layers, vocab_size=8192))
        rows = [("kept e4m3 (forced triton: CUDA's layout)", measure(model_dir, "triton")),
                ("round trip into float32 stacks (CPU default)", measure(model_dir, None))]
    print(f"random Qwen3-MoE: hidden 2048, {args.layers} layer(s) x {args.experts} experts of 768, vocab 8192")
    print("| experts | expert kernels | expert MiB held | model MiB held | load peak MiB | load s |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {', '.join(r['kernels']) or '-'} | {r['experts'] / MIB:.1f} "
              f"({r['experts'] / r['float_experts']:.3f}x float32) | {r['held'] / MIB:.1f} | {r['peak'] / MIB:.1f} | "
              f"{r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
