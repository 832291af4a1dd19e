"""The MoE experts' CPU grouped path (layers/fused_moe/grouped.py) with and without activation quantization
inside the experts (W8A8: layers/quantization/expert_input_quant.py), one Qwen3-MoE-sized layer slice (32 experts,
hidden 1024, expert intermediate 512, top 4), one thread, interleaved rounds, medians. With `--baseline
FILE` (another grouped.py, e.g. `git show main:kubeinfer/engine/model_executor/layers/fused_moe/grouped.py > /tmp/g.py`)
the float path is also timed against it and checked bit-equal.

    python benchmarks/bench_moe_w8a8.py [--baseline /tmp/g.py] [--rounds 30]
"""
from __future__ import annotations

import argparse
import importlib.util
import time

import torch

from kubeinfer.engine.model_executor.layers.fused_moe.activation import silu_and_mul
from kubeinfer.engine.model_executor.layers.fused_moe.grouped import grouped_experts
from kubeinfer.engine.model_executor.layers.quantization.expert_input_quant import ExpertInputQuant
from kubeinfer.engine.model_executor.layers.quantization.activations import ActivationScheme

E, H, INTER, K = 32, 1024, 512, 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", help="another grouped.py to time the float path against")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runners = {"float": lambda *a: grouped_experts(*a, silu_and_mul)}
    fp8 = ExpertInputQuant(*[ActivationScheme("float", "group", True, group_size=128)] * 2, {})
    runners["fp8 per token group"] = lambda *a: grouped_experts(*a, silu_and_mul, input_quant=fp8)
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_grouped", args.baseline)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        runners["float (baseline)"] = lambda *a: module.grouped_experts(*a, silu_and_mul)
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(E, 2 * INTER, H, generator=g) * 0.02, torch.randn(E, H, INTER, generator=g) * 0.02
    for tokens in (1, 16, 64):
        x = torch.randn(tokens, H, generator=g)
        weights = torch.softmax(torch.randn(tokens, K, generator=g), -1)
        ids = torch.randint(0, E, (tokens, K), generator=g)
        inputs = (x, gate_up, down, weights, ids)
        if args.baseline:
            assert torch.equal(runners["float"](*inputs), runners["float (baseline)"](*inputs))
        times = {name: [] for name in runners}
        for r in range(args.rounds):
            for name in (list(runners) if r % 2 else list(runners)[::-1]):
                start = time.perf_counter()
                runners[name](*inputs)
                times[name].append(time.perf_counter() - start)
        median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        line = ", ".join(f"{name} {ms * 1e3:.3f} ms ({ms / median['float']:.2f}x)" for name, ms in median.items())
        print(f"{tokens} tokens: {line}")


if __name__ == "__main__":
    main()
