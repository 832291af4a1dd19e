"""A CPU decode step's decoder layers in one native call each run of layers (platforms/cpu/native_decode.py) against the
per-module native path (KUBEINFER_CPU_FUSED_LAYERS=0), and against llama.cpp at the same bit width (`--peer
llama.cpp`: Q4_0 and Q8_0 of the same weights, llama_cpp_peer.py), on the large model of bench_quantized_decode.py
(222M; its checkpoints under .cache, built on first use): W4A16 through KUBEINFER_QUANT_KERNEL=cpu_int4_vnni and
W8A16 through cpu_int8_vnni, batch 1 and 16. One engine per kernel; the switch is read at each step, so it flips
between steps: each round has a fused round, llama.cpp's, and one that flips the switch at every step (fused, per
module, fused...), their order rotated round to round, so all see the same load; best and median round, ms a step.

    python benchmarks/bench_cpu_fused_layers.py [--tokens 32] [--repeats 5] [--peer llama.cpp] [--kernels ...]
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

sys.path.insert(0, str(Path(__file__).parent))
import llama_cpp_peer  # noqa: E402
from bench_quantized_decode import BATCHES, MODELS, PROMPT_LEN, EngineSystem, LlamaCppSystem, checkpoints  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.engine import SamplingParams  # noqa: E402

KERNELS = (("cpu_int4_vnni", "w4a16", "Q4_0"), ("cpu_int8_vnni", "w8a16", "Q8_0"))


def alternating(engine: EngineSystem, prompts: list[list[int]]) -> dict[str, float]:
    """One round with the switch flipped at every step (fused, per module, fused, ...): median ms of each's steps
    (engine.step wall time, the prefill and the first two decodes left out). Neighbouring steps see the same load,
    so this A/B holds on a busy machine where whole rounds drift."""
    llm, times = engine.llm.engine, {"1": [], "0": []}
    params = SamplingParams(temperature=0, max_tokens=engine.tokens, ignore_eos=True)
    engine.rounds += 1
    for i, prompt in enumerate(prompts):
        llm.add_request(f"ab{engine.rounds}-{i}", list(prompt), params)
    step = 0
    while llm.has_unfinished_requests():
        switch = "01"[step % 2]
        os.environ["KUBEINFER_CPU_FUSED_LAYERS"] = switch
        start = time.perf_counter()
        llm.step()
        if step >= 3:
            times[switch].append((time.perf_counter() - start) * 1e3)
        step += 1
    return {k: statistics.median(v) for k, v in times.items()}


def measure(engine: EngineSystem, peer, batch: int, repeats: int) -> dict[str, list[float]]:
    """Per round: ms per step of the fused engine and of the peer (aggregate rates), and the step-by-step A/B of
    fused ("ab1") and per module ("ab0"); the three in an order rotated round to round."""
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(10, MODELS["large"][1]["vocab_size"], (PROMPT_LEN,), generator=gen).tolist()
               for _ in range(batch)]
    order = ["fused", "ab"] + (["peer"] if peer else [])
    steps: dict[str, list[float]] = {name: [] for name in ("fused", "ab1", "ab0", "peer")}
    engine.rate(prompts)  # warm-up
    for r in range(repeats):
        for name in order[r % len(order):] + order[:r % len(order)]:
            if name == "peer":
                steps[name].append(batch / peer.rate(prompts) * 1e3)
            elif name == "fused":
                os.environ["KUBEINFER_CPU_FUSED_LAYERS"] = "1"
                steps[name].append(batch / engine.rate(prompts) * 1e3)
            else:
                for switch, ms in alternating(engine, prompts).items():
                    steps["ab" + switch].append(ms)
    os.environ.pop("KUBEINFER_CPU_FUSED_LAYERS", None)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per setting, interleaved")
    parser.add_argument("--peer", choices=("llama.cpp",), help="also llama.cpp Q4_0 / Q8_0 in each round")
    parser.add_argument("--llama-cpp-converter", default=llama_cpp_peer.default_converter())
    parser.add_argument("--kernels", default=",".join(k for k, _, _ in KERNELS), help="comma-separated subset")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated, at most 16")
    args = parser.parse_args()
    made = checkpoints("large")
    if args.peer and (why := llama_cpp_peer.missing(args.llama_cpp_converter)):
        sys.exit(llama_cpp_peer.HOW_TO_INSTALL.format(missing=why))
    f32 = args.peer and llama_cpp_peer.convert(made["float32"], "f32", args.llama_cpp_converter, Path(".cache"))
    loads, rows = [os.getloadavg()[0]], []
    kernels, batches = args.kernels.split(","), [int(b) for b in args.batches.split(",")]
    if set(kernels) - {k for k, _, _ in KERNELS} or not all(1 <= b <= max(BATCHES) for b in batches):
        parser.error(f"--kernels: of {', '.join(k for k, _, _ in KERNELS)}; --batches: 1 to {max(BATCHES)}")
    for kernel, scheme, kind in (k for k in KERNELS if k[0] in kernels):
        engine = EngineSystem(made[scheme], args.tokens, kernel)
        peer = LlamaCppSystem(llama_cpp_peer.quantize(f32, kind), args.tokens) if args.peer else None
        for batch in batches:
            ms = measure(engine, peer, batch, args.repeats)
            loads.append(os.getloadavg()[0])
            best = {k: min(v) for k, v in ms.items()}
            med = {k: statistics.median(v) for k, v in ms.items()}
            row = (f"| {kernel} | {batch} | {best['ab1']:.2f} ({med['ab1']:.2f}) | {best['ab0']:.2f} "
                   f"({med['ab0']:.2f}) | {best['ab0'] / best['ab1']:.2f}x ({med['ab0'] / med['ab1']:.2f}x) | "
                   f"{best['fused']:.2f} ({med['fused']:.2f}) |")
            if peer:
                row += (f" {kind} {best['peer']:.2f} ({med['peer']:.2f}) | {best['peer'] / best['fused']:.2f}x "
                        f"({med['peer'] / med['fused']:.2f}x) |")
            rows.append(row)
            print(row, f"load {loads[-1]:.1f}", flush=True)
        engine.close()
        if peer:
            peer.close()
    peer_head = " llama.cpp, same bits | llama.cpp / fused (>1: ours faster) |" if args.peer else ""
    body = "\n".join([
        f"`python benchmarks/bench_cpu_fused_layers.py --tokens {args.tokens} --repeats {args.repeats} "
        f"--kernels {args.kernels} --batches {args.batches}"
        + (f" --peer {args.peer}" if args.peer else "") + f"`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{platform.machine()}, {os.cpu_count()} cores, 1-minute load {min(loads):.1f}-{max(loads):.1f} (the "
        "machine shared). Large model (222M), 32-token prompts, ms per decode step, best round (median of rounds). "
        "Fused: the decoder layers in one native call (platforms/cpu/native_decode.py); per module: "
        "KUBEINFER_CPU_FUSED_LAYERS=0. Step A/B: the switch flipped at every step of one round (each side's median "
        "step wall time); rate: ms a step from the aggregate decode rate of a round, as the peer's is measured.",
        "", "| kernel | batch | step A/B: fused | per module | per module / fused | fused, rate |" + peer_head,
        "|---|---|---|---|---|---|" + ("---|---|" if args.peer else ""), *rows])
    print("\n" + body)
    update_results("fused-decoder-layer", "Decoder layers of a CPU decode step in one native call", body)


if __name__ == "__main__":
    main()
