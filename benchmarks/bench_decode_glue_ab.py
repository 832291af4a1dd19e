"""Before / after for Python-side changes of the CPU decode step: the working tree against another checkout (a git
worktree of the base revision with its own `make setup`), whole engines of bench_quantized_decode's large model
(its checkpoints under .cache: run that benchmark once first). Python code cannot be swapped inside one process,
so each (system, side) round is its own process, the sides alternating (and which goes first alternating round by
round), so both see the same load. Per round: median ms of a decode step (engine.step wall time, the first 3 steps
left out) at batch 1 and 16; the table shows the best round's and the median round's.
`--split`: also the step's time outside the native kernels' C calls and lm_head (each timed by a wrapper, so both
sides pay the wrappers' ~0.3 us a call): the Python around the kernels, far less noisy than the whole step.
`--switch VAR`: instead of another checkout, this one with the environment variable VAR=0 (before) and VAR=1
(after), e.g. KUBEINFER_CPU_FUSED_LAYERS (the decoder layers in one native call, platforms/cpu/native_decode.py).
`python benchmarks/bench_decode_glue_ab.py --base ../wt-base [--repeats 3] [--split]`
`python benchmarks/bench_decode_glue_ab.py --switch KUBEINFER_CPU_FUSED_LAYERS [--systems cpu_int4_vnni,...]`"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEMS = {"cpu_int4_vnni": "bench-llama-222m-w4a16", "cpu_int8_vnni": "bench-llama-222m-w8a16",
           "float32": "bench-llama-222m"}
BATCHES = (1, 16)


def time_native_calls(spent: list[float]) -> None:
    """Every ctypes call of the native library (products, norms, activation, rotary, attention) adds its wall
    time to spent[0]: the library object and the two layer modules' cached handles wrapped (their private caches)."""
    from kubeinfer.engine.platforms.cpu import cpu_attention, cpu_fused_ops
    from kubeinfer.engine.platforms.cpu.native import ops

    def timed(fn):
        def call(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[0] += time.perf_counter() - start
        return call

    class Timed:
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            fn = getattr(self._lib, name)
            wrapped = timed(fn) if name.startswith("ki_") and name != "ki_init" else fn
            setattr(self, name, wrapped)  # once per name, as ctypes caches its functions
            return wrapped
    cpu_fused_ops._lib()  # argtypes set on the real functions first
    cpu_attention._kernel()
    cpu_decoder._lib()
    ops._state["lib"] = cpu_decoder._state["lib"] = Timed(ops.library())
    if cpu_fused_ops._state.get("lib") is not None:
        cpu_fused_ops._state["lib"] = ops._state["lib"]
    cpu_attention._state["fn"] = timed(cpu_attention._state["fn"])


def worker(system: str, tokens: int, split: bool) -> None:
    """One engine of `system` in this checkout: a warm-up round, then one round per batch; prints JSON."""
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # as the `kubeinfer` command sets it (two_cores.py)
    if system != "float32":
        os.environ["KUBEINFER_QUANT_KERNEL"] = system
    from kubeinfer.engine import LLM, SamplingParams

    spent = [0.0]
    if split:
        time_native_calls(spent)
    engine = LLM(str(Path(".cache") / SYSTEMS[system]), max_num_seqs=max(BATCHES), enable_prefix_caching=False,
                 num_kv_blocks=64 * max(BATCHES)).engine
    if split:
        lm_head = engine.runner.model.lm_head
        lm_head.forward = timed_forward(lm_head.forward, spent)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    out = {}
    for batch in (1, *BATCHES):  # the first: warm-up
        for i in range(batch):
            engine.add_request(f"{batch}-{len(out)}-{i}", [(7 * i + j) % 16000 + 10 for j in range(32)], params)
        steps = []
        while engine.has_unfinished_requests():
            spent[0] = 0.0
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start - (spent[0] if split else 0.0))
        out[batch] = statistics.median(steps[3:]) * 1e3
    print(json.dumps(out))


def timed_forward(forward, spent: list[float]):
    def call(x):
        start = time.perf_counter()
        try:
            return forward(x)
        finally:
            spent[0] += time.perf_counter() - start
    return call


def run_side(checkout: Path, system: str, tokens: int, split: bool, env: dict | None = None) -> dict[int, float]:
    python = checkout / ".venv" / "bin" / "python"
    command = [str(python), str(HERE / Path(__file__).name), "--worker", system, "--tokens", str(tokens)]
    done = subprocess.run(command + ["--split"] * split, cwd=checkout, capture_output=True, text=True, check=True,
                          env=None if env is None else {**os.environ, **env})
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, help="the other checkout (with its .venv and the .cache checkpoints)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--split", action="store_true", help="ms of a step outside the native calls and lm_head")
    parser.add_argument("--switch", help="A/B of this environment variable (0 before, 1 after) in this checkout")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of " + ", ".join(SYSTEMS))
    parser.add_argument("--worker", choices=tuple(SYSTEMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.tokens, args.split)
    if (args.base is None) == (args.switch is None):
        parser.error("one of --base and --switch is required")
    systems = args.systems.split(",")
    if set(systems) - set(SYSTEMS):
        parser.error(f"--systems: of {', '.join(SYSTEMS)}")
    if args.switch:
        sides, envs = {"before": HERE.parent, "after": HERE.parent}, {"before": {args.switch: "0"},
                                                                       "after": {args.switch: "1"}}
    else:
        sides, envs = {"before": args.base.resolve(), "after": HERE.parent}, {"before": None, "after": None}
    ms: dict[tuple[str, str, int], list[float]] = {}
    loads = [os.getloadavg()[0]]
    for r in range(args.repeats):
        for system in systems:
            for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                for batch, value in run_side(sides[side], system, args.tokens, args.split, envs[side]).items():
                    ms.setdefault((system, side, batch), []).append(value)
            loads.append(os.getloadavg()[0])
            print(r, system, {f"{k[1]} b{k[2]}": f"{v[-1]:.2f}" for k, v in ms.items() if k[0] == system},
                  f"load {loads[-1]:.1f}", flush=True)
    rows = []
    for system in systems:
        for batch in BATCHES:
            before, after = ms[(system, "before", batch)], ms[(system, "after", batch)]
            rows.append(f"| {system} | {batch} | {min(before):.2f} ({statistics.median(before):.2f}) | "
                        f"{min(after):.2f} ({statistics.median(after):.2f}) | {min(before) / min(after):.2f}x "
                        f"({statistics.median(before) / statistics.median(after):.2f}x) |")
    print(f"\n{platform.machine()}, {os.cpu_count()} cores, 1-minute load {min(loads):.1f}-{max(loads):.1f}, "
          f"{args.repeats} rounds per side, {args.tokens} tokens\n")
    what = "ms/step outside the native calls and lm_head" if args.split else "ms/step"
    print(f"| system | batch | before {what}, best (median) | after | speed-up best (median) |\n|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    sys.exit(main())
