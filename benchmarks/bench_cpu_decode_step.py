"""A CPU decode step with and without the work shared between the two cores (platforms/cpu/two_cores.py: kept-int
products in two halves of their output rows, decode attention of 4+ sequences in two halves of the batch), in
one process, interleaved: the same engines run each round once with `two_cores.ENABLED` off (the step as it
was: torch on one thread, OpenBLAS on every core for float32 projections) and once on. bench_quantized_decode's
models (`large` by default) and engines (max_num_seqs 16); optionally llama.cpp's Q8_0 / Q4_0 in the same rounds.

    [OPENBLAS_THREAD_TIMEOUT=4] python benchmarks/bench_cpu_decode_step.py [--model large] [--tokens 32]
        [--repeats 5] [--peer llama.cpp]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import llama_cpp_peer  # noqa: E402
from bench_quantized_decode import BATCHES, MODELS, PROMPT_LEN, EngineSystem, LlamaCppSystem, checkpoints  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.engine.platforms.cpu import two_cores  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="large", choices=tuple(MODELS))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peer", choices=("llama.cpp",))
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    made = checkpoints(args.model)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, MODELS[args.model][1]["vocab_size"], (PROMPT_LEN,), generator=gen).tolist()
               for _ in range(max(BATCHES))]
    engines = {name: EngineSystem(made[key], args.tokens)
               for name, key in (("float32", "float32"), ("W8A16", "w8a16"), ("W4A16", "w4a16"))}
    peers = {}
    if args.peer and not llama_cpp_peer.missing(llama_cpp_peer.default_converter()):
        f32 = llama_cpp_peer.convert(made["float32"], "f32", llama_cpp_peer.default_converter(), Path(".cache"))
        peers = {f"llama.cpp {kind}": LlamaCppSystem(llama_cpp_peer.quantize(f32, kind), args.tokens)
                 for kind in ("Q8_0", "Q4_0")}
    for engine in engines.values():
        engine.rate(prompts[:1])  # warm-up
    rates: dict[tuple[str, int], list[float]] = {}
    loads = []
    for _ in range(args.repeats):
        for batch in BATCHES:
            for name, engine in engines.items():
                for shared in (False, True):
                    two_cores.ENABLED = shared
                    label = f"engine {name}, " + ("two cores shared (after)" if shared else "one torch thread (before)")
                    rates.setdefault((label, batch), []).append(engine.rate(prompts[:batch]))
            for label, peer in peers.items():
                rates.setdefault((label, batch), []).append(peer.rate(prompts[:batch]))
        loads.append(os.getloadavg()[0])
        print({f"{k[0]} @{k[1]}": f"{max(v):.1f}" for k, v in rates.items()}, f"load {loads[-1]:.1f}")
    two_cores.ENABLED = True
    for system in (*engines.values(), *peers.values()):
        system.close()
    lines = ["| system | batch 1 tok/s (best / median) | ms per step | batch 16 tok/s (best / median) | ms per step |",
             "|---|---|---|---|---|"]
    for label in dict.fromkeys(label for label, _ in rates):
        cells = []
        for batch in BATCHES:
            r = rates[(label, batch)]
            cells += [f"{max(r):.1f} / {statistics.median(r):.1f}", f"{1000 * batch / max(r):.2f}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    for name in engines:
        before, after = (f"engine {name}, one torch thread (before)", f"engine {name}, two cores shared (after)")
        ratios = [f"batch {b} {max(rates[(after, b)]) / max(rates[(before, b)]):.2f}x best, "
                  f"{statistics.median(rates[(after, b)]) / statistics.median(rates[(before, b)]):.2f}x median"
                  for b in BATCHES]
        lines.append(f"- {name}: after / before: " + "; ".join(ratios))
    body = "\n".join([
        f"Command: `python benchmarks/bench_cpu_decode_step.py --model {args.model} --tokens {args.tokens} "
        f"--repeats {args.repeats}" + (f" --peer {args.peer}" if args.peer else "") + "`. "
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs, load average "
        f"{min(loads):.1f}-{max(loads):.1f} while measured; torch {torch.__version__}; OPENBLAS_THREAD_TIMEOUT="
        f"{os.environ.get('OPENBLAS_THREAD_TIMEOUT', 'unset')} (before and after alike). {PROMPT_LEN}-token prompts, "
        f"{args.tokens} tokens greedy, aggregate decode tokens/s; {args.repeats} rounds, before and after "
        "interleaved in each round on the same engines; best and median round.", "", *lines])
    print(body)
    if not args.no_write:
        update_results("cpu-decode-step", "CPU decode step: work shared between the two cores", body)


if __name__ == "__main__":
    main()
