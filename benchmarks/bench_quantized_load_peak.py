"""The memory peak of loading a quantized checkpoint: the bytes torch holds live during `LLM(...)` (tests/
load_peak.py: every storage torch's operators create, until freed) against the bytes the loaded model holds, for
the 222M random Llama of bench_quantized_decode.py (`large`) as W4A16, W8A16 (compressed-tensors pack-quantized),
block-wise fp8 and `--quantization fp8` on the float checkpoint (fp8 kept through KUBEINFER_QUANT_KERNEL=triton on
the CPU, as on CUDA; nothing is multiplied at load). `--before DIR` also measures another checkout's engine (e.g.
`git worktree add /tmp/before main~1`), each load in its own process, the two interleaved. Not RSS: a CPU
allocation no one writes is never resident (the float weights `to_empty` took and the loader never wrote did not
show), and ru_maxrss survives exec (a child starts with its parent's); on CUDA every allocation counts.

    python benchmarks/bench_quantized_load_peak.py [--before DIR] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path[:0] = [str(Path(__file__).parents[1] / "tests"), str(Path(__file__).parents[1] / "tests" / "engine")]
FORMATS = ("w4a16", "w8a16", "fp8", "fp8-at-load")


def measure(model_dir: str, fmt: str) -> dict:
    """One load in this process: {peak, held, projections (float32 bytes)} in bytes, and the kernels."""
    import torch
    from load_peak import LiveBytes, held_bytes

    from kubeinfer.engine import LLM

    if fmt.startswith("fp8"):
        os.environ["KUBEINFER_QUANT_KERNEL"] = "triton"
        os.environ.setdefault("TRITON_INTERPRET", "1")
    with LiveBytes() as live:
        at_load = {"quantization": "fp8"} if fmt == "fp8-at-load" else {}
        model = LLM(model_dir, max_model_len=256, num_kv_blocks=16, **at_load).engine.runner.model
    projections = sum(m.weight.numel() * 4 for n, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and ".layers." in n)
    return {"peak": live.peak, "held": held_bytes(model), "projections": projections,
            "kernels": sorted(set(model.quant_kernels.values()))}


def checkpoints() -> dict[str, str]:
    from bench_quantized_decode import checkpoints as int_checkpoints
    from quant_checkpoints import float_weights, write_checkpoint
    from test_quantized_fp8 import fp8_config, fp8_quantize

    made = {k: str(v) for k, v in int_checkpoints("large").items()}
    fp8_dir = Path(made["float32"] + "-fp8")
    if not (fp8_dir / "config.json").exists():
        weights = float_weights(Path(made["float32"]))
        write_checkpoint(Path(made["float32"]), fp8_dir, fp8_quantize(weights, [128, 128]), fp8_config([128, 128]))
    made["fp8"], made["fp8-at-load"] = str(fp8_dir), made["float32"]
    return made


def child(source: str | None, model_dir: str, fmt: str) -> dict:
    """`measure` in a fresh process, its engine from `source` (another checkout) when given."""
    code = ("import sys, json; sys.path.insert(0, %r)\n" % str(Path(__file__).parent)
            + (f"from bench_quantized_load_peak import use_source; use_source({source!r})\n" if source else "")
            + f"from bench_quantized_load_peak import measure; print(json.dumps(measure({model_dir!r}, {fmt!r})))")
    # Not from the repository root: `python -c` puts the working folder first on sys.path, where this checkout's
    # kubeinfer/ would win over the `source` the editable install is pointed at.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


def use_source(source: str) -> None:
    """Points the editable install's packages at another checkout (its engine measured instead of this one's); a
    checkout from before the folders became the import names (engine/ beside kubeinfer/) is mapped as it was."""
    source_root = Path(source).resolve()
    old = {f"kubeinfer.{part}": str(source_root / part) for part in ("engine", "gateway", "operator")
           if not (source_root / "kubeinfer" / part).is_dir() and (source_root / part).is_dir()}
    for finder in sys.meta_path:
        mapping = getattr(sys.modules.get(getattr(finder, "__module__", "")), "MAPPING", None)
        if isinstance(mapping, dict) and "kubeinfer" in mapping:
            root = str(Path(mapping["kubeinfer"]).parent)
            mapping.update({k: v.replace(root, str(source_root), 1) for k, v in mapping.items()})
            mapping.update(old)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", help="another checkout whose engine is measured too (the baseline)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds (torch's peak repeats to the byte)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/RESULTS.md")
    args = parser.parse_args()
    dirs = checkpoints()
    systems = ([("before", args.before)] if args.before else []) + [("after", None)]
    rows = {}
    for _ in range(args.repeats):
        for fmt in FORMATS:
            for label, source in systems:
                r = child(source, dirs[fmt], fmt)
                best = rows.get((fmt, label))
                rows[(fmt, label)] = r if best is None or r["peak"] < best["peak"] else best
                print(fmt, label, r, flush=True)
    mib = lambda b: f"{b / (1 << 20):.0f}"  # noqa: E731
    lines = ["| checkpoint | engine | kernels | held MiB | float32 projections MiB | load peak MiB (torch) | "
             "peak over held |", "|---|---|---|---|---|---|---|"]
    for (fmt, label), r in rows.items():
        lines.append(f"| {fmt} | {label} | {', '.join(r['kernels'])} | {mib(r['held'])} | {mib(r['projections'])} | "
                     f"{mib(r['peak'])} | {(r['peak'] - r['held']) / r['projections']:.2f}x projections |")
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        from results import update_results

        load = os.getloadavg()
        body = (f"222M random Llama (`large` of bench_quantized_decode.py), float32 model, each load in a fresh "
                f"process, lowest torch peak of {args.repeats} interleaved rounds; {platform.processor() or 'CPU'}, "
                f"{os.cpu_count()} cores, load {load[0]:.1f}. `python benchmarks/bench_quantized_load_peak.py"
                f"{' --before DIR' if args.before else ''}` (before: {args.before}).\n\n{table}\n")
        update_results("quantized-load-peak", "Quantized checkpoints: the load's memory peak", body)


if __name__ == "__main__":
    main()
