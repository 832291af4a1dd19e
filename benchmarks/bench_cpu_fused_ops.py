"""A decode step's non-matmul ops native (platforms/cpu/cpu_fused_ops.py: RMSNorm + residual add, silu(gate) * up,
rotary;
platforms/cpu/cpu_attention.py: the decode attention) or torch, on the large model of bench_quantized_decode.py
(222M; its
checkpoints under .cache, built on first use): float32 and W8A16 through KUBEINFER_QUANT_KERNEL=cpu_int8_vnni, batch
1 and 16. One engine per model; the switch KUBEINFER_CPU_NATIVE_LAYERS (the engine's
kernels.cpu_native_layers, flipped on the built engine) flips between rounds, on
and off alternating in each round and their order swapped round to round, so both see the same load; best and median
round, ms per decode step.

    python benchmarks/bench_cpu_fused_ops.py [--tokens 32] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # as bench_quantized_decode.py: before numpy loads OpenBLAS
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_quantized_decode import BATCHES, PROMPT_LEN, EngineSystem, checkpoints  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.engine.platforms.cpu import cpu_fused_ops  # noqa: E402
from kubeinfer.engine.model_executor.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

SYSTEMS = (("float32", "float32", None), ("W8A16 cpu_int8_vnni", "w8a16", "cpu_int8_vnni"))


def measure(system: EngineSystem, batch: int, repeats: int) -> dict[str, list[float]]:
    """ms per step of each switch setting, `repeats` rounds each, interleaved."""
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(PROMPT_LEN)] for i in range(batch)]
    steps: dict[str, list[float]] = {"1": [], "0": []}
    system.rate(prompts)  # warm-up
    for r in range(repeats):
        for switch in ("1", "0") if r % 2 == 0 else ("0", "1"):
            system.llm.engine.runner.kernels.cpu_native_layers = switch == "1"  # the engine's, seen at its next step
            steps[switch].append(batch / system.rate(prompts) * 1e3)
    system.llm.engine.runner.kernels.cpu_native_layers = True
    return steps


def op_calls(batch: int, calls: int = 200, rounds: int = 7) -> list[str]:
    """us per call of each op at the large model's shapes, native against the torch code it replaces (the modules'
    own fallbacks), interleaved round by round; the best round of `calls` calls."""
    hidden, inter, heads, head_dim = 1024, 4096, 16 + 8, 64
    x, residual, weight = torch.randn(batch, hidden), torch.randn(batch, hidden), torch.randn(hidden)
    gate_up, qkv = torch.randn(batch, 2 * inter), torch.randn(batch, (heads + 8) * head_dim)
    rotary, positions = RotaryEmbedding(head_dim, 4096, 10000.0, {}), torch.arange(batch) + 40
    qk = qkv[:, :heads * head_dim].view(batch, heads, head_dim)

    def torch_norm():
        s = x + residual
        return F.rms_norm(s, (hidden,), weight, 1e-6), s

    def torch_act():
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up
    ops = {"RMSNorm + residual add": (lambda: cpu_fused_ops.rms_norm(x, weight, 1e-6, residual), torch_norm),
           "silu(gate) * up": (lambda: cpu_fused_ops.silu_mul(gate_up, inter), torch_act),
           "rotary, q and k": (lambda: rotary.rotate_scratch(positions, qk), lambda: rotary.rotate(positions, qk))}
    rows = []
    with torch.inference_mode():
        for name, pair in ops.items():
            best = [float("inf"), float("inf")]
            for _ in range(rounds):
                for i, fn in enumerate(pair):
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    best[i] = min(best[i], (time.perf_counter() - start) / calls * 1e6)
            rows.append(f"| {name} | {batch} | {best[0]:.1f} | {best[1]:.1f} | {best[1] / best[0]:.2f}x |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per setting, interleaved")
    args = parser.parse_args()
    os.environ["KUBEINFER_CPU_NATIVE_LAYERS"] = "1"
    loads = [os.getloadavg()[0]]
    op_rows = [row for batch in BATCHES for row in op_calls(batch)]
    os.environ.pop("KUBEINFER_CPU_NATIVE_LAYERS")
    made = checkpoints("large")
    rows = []
    for label, scheme, kernel in SYSTEMS:
        system = EngineSystem(made[scheme], args.tokens, kernel)
        for batch in BATCHES:
            loads.append(os.getloadavg()[0])
            steps = measure(system, batch, args.repeats)
            on, off = min(steps["1"]), min(steps["0"])
            rows.append(f"| {label} | {batch} | {on:.2f} ({statistics.median(steps['1']):.2f}) | "
                        f"{off:.2f} ({statistics.median(steps['0']):.2f}) | {off / on:.2f}x |")
            print(rows[-1], flush=True)
        system.close()
    body = "\n".join([
        f"Command: `python benchmarks/bench_cpu_fused_ops.py --tokens {args.tokens} --repeats {args.repeats}`. "
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs (1-minute load "
        f"{min(loads):.1f}-{max(loads):.1f} during the run), torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads. Large model (222M: hidden 1024, 12 layers, 16/8 heads, intermediate 4096); {PROMPT_LEN}-token "
        f"prompts, {args.tokens} tokens greedy; ms per decode step from the aggregate decode rate; "
        f"KUBEINFER_CPU_NATIVE_LAYERS=1 (native norm, activation, rotary, decode attention) and =0 (torch) alternating "
        f"round by round "
        f"in one engine; best round (median).", "",
        "| system | batch | native ms/step | torch ms/step | speed-up |", "|---|---|---|---|---|", *rows, "",
        "Each op alone at the large model's shapes (us per call, best of 7 rounds of 200 calls, interleaved; rotary: "
        "the 16 + 8 heads of q and k side by side in the qkv rows, torch's tables cached as in a step):", "",
        "| op | tokens | native us | torch us | speed-up |", "|---|---|---|---|---|", *op_rows])
    print(body)
    update_results("cpu-native-fused-ops", "Native small ops of a CPU decode step (norm, activation, rotary)", body)


if __name__ == "__main__":
    main()
