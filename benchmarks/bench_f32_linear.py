"""Per-call times of float32 `x @ w.T` at small batches: the native product (platforms/cpu/native/f32_linear.c, the
pool's
threads) against what the engine runs today in a small step (OpenBLAS through numpy, every core; torch on one
thread, cpu_blas.py) and torch's F.linear on its own threads; the large benchmark model's shapes (lm_head
[16384, 1024] and the layers' qkv / o / gate_up / down). Interleaved: each round times every variant once, in
an order rotated round to round; best and median round, microseconds per call.

`--engine`: the whole engine on the large model of bench_quantized_decode.py (222M, its checkpoints under .cache),
float32 and the llama.cpp-arithmetic W8A16 / W4A16 kernels, with the native lm_head (platforms/cpu/native_lm_head.py)
against the same engine's lm_head through OpenBLAS (the wrapper taken off between rounds: one engine, both arms
alternating and their order swapped round to round), optionally against llama.cpp (`--peer llama.cpp`, f32 / Q8_0
/ Q4_0 of the same weights) in the same rounds; best and median round, tokens per second of decode.

    python benchmarks/bench_f32_linear.py [--batches 1,16] [--calls 50] [--rounds 7]
    python benchmarks/bench_f32_linear.py --engine [--peer llama.cpp] [--tokens 32] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # as the engine's benchmarks: before numpy loads OpenBLAS
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kubeinfer.engine.platforms.cpu.native import f32_ops  # noqa: E402

SHAPES = {"lm_head": (16384, 1024), "qkv": (2048, 1024), "o": (1024, 1024), "gate_up": (8192, 1024),
          "down": (1024, 4096)}


def variants(x: torch.Tensor, w: torch.Tensor) -> dict:
    wt = w.numpy().T
    threads = torch.get_num_threads()

    def torch_one():
        torch.set_num_threads(1)
        try:
            return F.linear(x, w)
        finally:
            torch.set_num_threads(threads)
    return {"native": lambda: f32_ops.f32_linear(x, w), "openblas": lambda: np.matmul(x.numpy(), wt),
            "torch 1 thread": torch_one, "torch F.linear": lambda: F.linear(x, w)}


def measure(batch: int, shape: tuple[int, int], calls: int, rounds: int) -> dict[str, list[float]]:
    n, k = shape
    x, w = torch.randn(batch, k), torch.randn(n, k)
    runs = variants(x, w)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            for _ in range(calls):
                runs[name]()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return times


def native_layers(model) -> list:
    """(layer, native forward, today's forward) of each float32 projection but lm_head: the layers arm of --engine."""
    from kubeinfer.engine.platforms.cpu import cpu_blas
    swaps = []
    for name, layer in model.named_modules():
        if (isinstance(layer, torch.nn.Linear) and name != "lm_head" and not hasattr(layer, "quant_method")
                and layer.bias is None and layer.weight.dtype == torch.float32):
            def native(x, _w=layer.weight, _prev=layer.forward):
                if cpu_blas.in_small_step() and f32_ops.wants(x):
                    return f32_ops.f32_linear(x, _w)
                return _prev(x)
            swaps.append((layer, native, layer.forward))
    return swaps


def engine_ab(args) -> None:
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    import llama_cpp_peer
    from bench_quantized_decode import PROMPT_LEN, EngineSystem, LlamaCppSystem, checkpoints

    made = checkpoints("large")
    wanted = args.systems.split(",")
    engines = {label: EngineSystem(made[ckpt], args.tokens, kernel) for key, label, ckpt, kernel in (
        ("float32", "float32", "float32", None), ("int8", "W8A16 cpu_int8_vnni", "w8a16", "cpu_int8_vnni"),
        ("int4", "W4A16 cpu_int4_vnni", "w4a16", "cpu_int4_vnni")) if key in wanted}
    peers = {}
    if args.peer:
        f32 = llama_cpp_peer.convert(made["float32"], "f32", llama_cpp_peer.default_converter(), Path(".cache"))
        peers = {"llama.cpp f32": LlamaCppSystem(f32, args.tokens)}
        for kind in ("Q8_0", "Q4_0"):
            peers[f"llama.cpp {kind}"] = LlamaCppSystem(llama_cpp_peer.quantize(f32, kind), args.tokens)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 16384, (PROMPT_LEN,), generator=gen).tolist() for _ in range(16)]
    heads = {}
    for name, system in engines.items():
        head = system.llm.engine.runner.model.lm_head
        assert hasattr(head.forward, "previous"), f"{name}: the native lm_head is not installed"
        heads[name] = (head, head.forward, head.forward.previous)
        system.rate(prompts[:1])
    layers = native_layers(engines["float32"].llm.engine.runner.model) if args.layers and "float32" in engines else []
    rates: dict[tuple[str, int], list[float]] = {}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for batch in (int(b) for b in args.batches.split(",")):
            for name, system in engines.items():
                head, native, blas = heads[name]
                for arm in ("native", "OpenBLAS") if r % 2 == 0 else ("OpenBLAS", "native"):
                    head.forward = native if arm == "native" else blas
                    rates.setdefault((f"{name}, lm_head {arm}", batch), []).append(system.rate(prompts[:batch]))
                head.forward = native
            if layers:  # float32 with every projection native (lm_head too)
                for layer, native, _ in layers:
                    layer.forward = native
                rates.setdefault(("float32, all products native", batch), []).append(
                    engines["float32"].rate(prompts[:batch]))
                for layer, _, blas in layers:
                    layer.forward = blas
            for name, peer in peers.items():
                rates.setdefault((name, batch), []).append(peer.rate(prompts[:batch]))
        loads.append(os.getloadavg()[0])
        print({f"{k[0]} @{k[1]}": f"{max(v):.1f}" for k, v in rates.items()}, f"load {loads[-1]:.2f}", flush=True)
    print(f"\n{platform.node()}, load average {min(loads):.2f}-{max(loads):.2f}, {args.rounds} rounds, "
          f"{args.tokens} tokens a request; tok/s best (median)\n")
    print("| system | " + " | ".join(f"batch {b}" for b in args.batches.split(",")) + " |")
    print("|---|" + "---|" * len(args.batches.split(",")))
    for label in dict.fromkeys(k[0] for k in rates):
        print(f"| {label} | " + " | ".join(f"{max(rates[(label, int(b))]):.1f} "
                                           f"({statistics.median(rates[(label, int(b))]):.1f})"
                                           for b in args.batches.split(",")) + " |")
    med = {key: statistics.median(v) for key, v in rates.items()}
    for name in engines:
        print(f"- {name}: native / OpenBLAS lm_head " + ", ".join(
            f"batch {b} {med[(name + ', lm_head native', int(b))] / med[(name + ', lm_head OpenBLAS', int(b))]:.2f}x"
            for b in args.batches.split(",")) + " (medians)")
    for system in [*engines.values(), *peers.values()]:
        system.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--engine", action="store_true", help="whole-engine A/B of the native lm_head instead")
    parser.add_argument("--peer", choices=("llama.cpp",), help="with --engine: llama.cpp in the same rounds")
    parser.add_argument("--systems", default="float32,int8,int4", help="with --engine: which engines")
    parser.add_argument("--layers", action="store_true", help="with --engine: also float32 with all products native")
    parser.add_argument("--tokens", type=int, default=32, help="with --engine: tokens generated per request")
    args = parser.parse_args()
    if args.engine:
        engine_ab(args)
        return
    print(f"# {platform.node()} {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"load before {os.getloadavg()[0]:.2f}")
    print("| batch | product [N, K] | native | OpenBLAS | torch 1 thread | torch F.linear | OpenBLAS / native |")
    print("|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        for name in args.shapes.split(","):
            t = measure(batch, SHAPES[name], args.calls, args.rounds)
            cell = {v: f"{min(s):.0f} ({statistics.median(s):.0f})" for v, s in t.items()}
            ratio = statistics.median(t["openblas"]) / statistics.median(t["native"])
            print(f"| {batch} | {name} {list(SHAPES[name])} | {cell['native']} | {cell['openblas']} | "
                  f"{cell['torch 1 thread']} | {cell['torch F.linear']} | {ratio:.2f}x |", flush=True)
    print(f"# load after {os.getloadavg()[0]:.2f}; us per call, best (median) of the rounds")


if __name__ == "__main__":
    main()
