"""Decode speed per x86-64 level of the native CPU kernels (cpu_native/build.py), on whatever CPU this runs: the
engine's float32, W8A16 (int8 per channel) and W4A16 (int4, groups of 32) checkpoints of one model at batch 1 and 16,
with each level's library this CPU runs (v4: AVX-512 VNNI/BF16, v3: AVX2/FMA/F16C; forced by KUBEINFER_CPU_LEVEL),
against llama.cpp f32 / Q8_0 / Q4_0 of the same weights and token ids (llama_cpp_peer.py: its quantizer, the output
matrix kept f32 as the checkpoints keep lm_head). Prints the CPU's model name, its SIMD flags and the level each
round ran.

One process: each round runs every system at each batch, interleaved; the engine's rounds once per level, the
level switched by dropping the loaded library (ops._state) so that the next product loads the forced one (the
layers' kernels and packed weights are the same on v3 and v4: the A16 product and the float32 one have a vector
path on both). Best round reported, median beside it (a shared machine: the best round is the least disturbed).
llama.cpp runs the build pip made here (its own CPU dispatch), the same in every level's table.

    python benchmarks/bench_cpu_levels.py --peer llama.cpp [--tokens 32] [--repeats 5] [--levels v4,v3]

Model (the issue 47 report's): a random-init Llama, hidden 768, 8 layers, intermediate 2048, vocab 32000 (106M).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

# as the `kubeinfer` command does (kubeinfer/cli.py), before numpy loads OpenBLAS: small steps share the cores
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import llama_cpp_peer  # noqa: E402
from bench_quantized_decode import EngineSystem, LlamaCppSystem  # noqa: E402
from quant_checkpoints import ct_compress, ct_scheme, float_weights, write_checkpoint  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402
from kubeinfer.engine.platforms.cpu.native import build, ops  # noqa: E402

SHAPE = dict(hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4, intermediate_size=2048, vocab_size=32000,
             max_position_embeddings=1024)
SCHEMES = {"w8a16": ("pack-quantized", 8, "int", "channel", True, None),
           "w4a16": ("pack-quantized", 4, "int", "group", True, 32)}
PAIRS = (("float32", "llama.cpp f32"), ("W8A16", "llama.cpp Q8_0"), ("W4A16", "llama.cpp Q4_0"),
         ("W8A16 torch bf16", "llama.cpp Q8_0"), ("W4A16 torch bf16", "llama.cpp Q4_0"))
BATCHES, PROMPT_LEN = (1, 16), 32
SIMD = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
        "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def checkpoints() -> dict[str, Path]:
    root = Path(".cache")
    made = {"float32": root / "bench-llama-106m"}
    if not (made["float32"] / "config.json").exists():
        build_random_model(made["float32"], "llama", tokenizer=False, initializer_range=0.02, **SHAPE)
    for scheme, args in SCHEMES.items():
        made[scheme] = root / f"bench-llama-106m-{scheme}"
        if not (made[scheme] / "config.json").exists():
            config = ct_scheme(*args)
            write_checkpoint(made["float32"], made[scheme], ct_compress(float_weights(made["float32"]), config), config)
    return made


def cpu_line() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.partition(":")[2].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = build.cpu_flags(info)
    return (f"{model} ({platform.machine()}, {os.cpu_count()} cores); SIMD flags: "
            + " ".join(f for f in SIMD if f in flags) + f"; best level {build.best_level(flags)}")


def use_level(level: str) -> None:
    os.environ["KUBEINFER_CPU_LEVEL"] = level
    ops._state.clear()
    assert ops.available() and ops.level() == level, (level, ops.level())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--levels", default="", help="comma-separated (default: every level this CPU runs but "
                        "portable)")
    parser.add_argument("--peer", choices=("llama.cpp",))
    parser.add_argument("--llama-cpp-converter", default=llama_cpp_peer.default_converter())
    parser.add_argument("--no-write", action="store_true", help="print, do not write RESULTS.md")
    args = parser.parse_args()
    runs = [lv for lv in ("v4", "v3") if set(build.LEVELS[lv][1]) <= build.cpu_flags()]
    levels = args.levels.split(",") if args.levels else runs
    print(cpu_line(), "| levels:", levels)
    made = checkpoints()
    use_level(levels[0])
    engines = {"float32": EngineSystem(made["float32"], args.tokens), "W8A16": EngineSystem(made["w8a16"], args.tokens),
               "W4A16": EngineSystem(made["w4a16"], args.tokens),
               # what a CPU without AVX-512 BF16 ran before the v3 build: torch's weight-only bf16 products
               "W8A16 torch bf16": EngineSystem(made["w8a16"], args.tokens, "cpu_int8_bf16"),
               "W4A16 torch bf16": EngineSystem(made["w4a16"], args.tokens, "cpu_int4_bf16")}
    peers, note = {}, ""
    if args.peer:
        why_not = llama_cpp_peer.missing(args.llama_cpp_converter)
        if why_not:
            note = llama_cpp_peer.HOW_TO_INSTALL.format(missing=why_not)
            print(note)
        else:
            f32 = llama_cpp_peer.convert(made["float32"], "f32", args.llama_cpp_converter, Path(".cache"))
            peers = {"llama.cpp f32": LlamaCppSystem(f32, args.tokens)}
            for kind in ("Q8_0", "Q4_0"):
                peers[f"llama.cpp {kind}"] = LlamaCppSystem(llama_cpp_peer.quantize(f32, kind), args.tokens)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, SHAPE["vocab_size"], (PROMPT_LEN,), generator=gen).tolist() for _ in range(16)]
    for level in levels:  # warm-up: each level's library built and its first steps run
        use_level(level)
        for engine in engines.values():
            engine.rate(prompts[:1])
    rates: dict[tuple[str, str, int], list[float]] = {}
    loads = []
    for _ in range(args.repeats):
        for batch in BATCHES:
            for level in levels:
                use_level(level)
                for label, engine in engines.items():
                    rates.setdefault((level, label, batch), []).append(engine.rate(prompts[:batch]))
                for label, peer in peers.items():  # between the levels' engine rounds
                    rates.setdefault(("peer", label, batch), []).append(peer.rate(prompts[:batch]))
        loads.append(os.getloadavg()[0])
        print({f"{k[0]} {k[1]} @{k[2]}": f"{max(v):.1f}" for k, v in rates.items()}, f"load {loads[-1]:.1f}")
    kernels = {label: ", ".join(e.kernels) for label, e in engines.items()}
    for system in [*engines.values(), *peers.values()]:
        system.close()
    os.environ.pop("KUBEINFER_CPU_LEVEL", None)
    text = report(args, levels, rates, kernels, loads, note)
    print(text)
    if not args.no_write:
        update_results("cpu-levels", "Decode per x86-64 level of the native kernels against llama.cpp (CPU)", text)


def peer_build() -> str:
    return (f" (llama-cpp-python {llama_cpp_peer.version()}, built here by pip, its own CPU dispatch: the same "
            "llama.cpp in every level's table)")


def report(args, levels, rates, kernels, loads, note: str) -> str:
    cell = lambda key: f"{max(rates[key]):.1f} / {statistics.median(rates[key]):.1f}"  # noqa: E731
    lines = [f"Command: `python benchmarks/bench_cpu_levels.py --tokens {args.tokens} --repeats {args.repeats}"
             + (f" --levels {args.levels}" if args.levels else "") + (f" --peer {args.peer}" if args.peer else "")
             + f"`. CPU: {cpu_line()}. torch {torch.__version__}, {torch.get_num_threads()} threads for the engine "
             "and llama.cpp" + (peer_build() if not note and args.peer else "")
             + f"; load average {min(loads):.1f}-{max(loads):.1f} while measured (the machine is shared). Model: "
             "random Llama, hidden 768, 8 layers, intermediate 2048, vocab 32000 (106M); W8A16 int8 per channel, "
             "W4A16 int4 groups of 32 (compressed-tensors package), lm_head float; llama.cpp Q8_0/Q4_0 by its "
             f"quantizer from the f32 GGUF, output matrix f32. {PROMPT_LEN}-token prompts, {args.tokens} greedy "
             f"tokens, same token ids; {args.repeats} rounds in one process, systems and levels interleaved in "
             "each; tok/s best / median round.", ""]
    for level in levels:
        lines += [f"**level {level}** (KUBEINFER_CPU_LEVEL={level})", "",
                  "| engine | kernels | batch 1 | batch 16 | llama.cpp | batch 1 | batch 16 | ratio 1 | ratio 16 |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for ours, theirs in PAIRS:
            peer = [("peer", theirs, b) in rates for b in BATCHES]
            ratio = [f"{max(rates[(level, ours, b)]) / max(rates[('peer', theirs, b)]):.2f}x" if ok else "-"
                     for b, ok in zip(BATCHES, peer)]
            theirs_cells = [cell(("peer", theirs, b)) if ok else "-" for b, ok in zip(BATCHES, peer)]
            lines.append(f"| {ours} | {kernels[ours]} | {cell((level, ours, 1))} | {cell((level, ours, 16))} | "
                         f"{theirs} | {' | '.join(theirs_cells)} | {' | '.join(ratio)} |")
        lines.append("")
    if note:
        lines.append(f"- {note}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
