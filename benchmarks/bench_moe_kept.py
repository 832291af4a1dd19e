"""Quantized MoE experts kept quantized (layers/fused_moe/int_experts.py) against dequantized at load, on the CPU.

1. One layer's experts (32 experts, hidden 1024, expert intermediate 512, top 4, bench_moe_w8a8.py's slice), one
   thread (torch's and the native pool), interleaved rounds, medians, at 1 / 16 / 64 tokens: float32 stacks
   (dequantized at load) through the grouped product; kept int8 / int4 per active expert through torch's
   weight-only products (`cpu_int*_bf16`: activations, dequantized weights and outputs rounded to bf16) and,
   where the native library builds with AVX-512 BF16, through the exact A16 product (`cpu_int*_a16`: the CPU
   default there); with --dequantized-per-step, only the step's active experts dequantized to float32 and
   multiplied (the alternative the choice was first measured against).
2. The whole engine on a random Qwen3-MoE (hidden 512, 4 layers, 32 experts of 512, top 4), compressed-tensors
   W8A16 (channel) and W4A16 (groups of 128) checkpoints of it: the weight bytes the engine holds and decode
   tok/s at batch 1 and 16, kept (the default), kept through torch's products (forced: dense layers too) and
   KUBEINFER_QUANT_KERNEL=dequantized, interleaved rounds, best and median.
3. W8A8 int8 (per channel) and W4A8 (int4, groups of 128) experts, int8 dynamic per-token inputs, before / after
   (fused_moe/a8_experts.py): the same layer as 1., before (what ran: the float32 stacks dequantized at load
   through the grouped product, the inputs fake-quantized per token by expert_input_quant.py) against each active
   expert's rows through the dense integer kernel (`int8_vnni` / `w4a8_vnni`, and the torch._int_mm twins); and
   the whole engine on W8A8 / W4A8 checkpoints of 2.'s model, the experts' kernel chosen (default) or as before
   (a8_experts.choose off: dequantized, fake-quantized inputs; the dense layers on their integer kernels in both).
   --a8-only runs only these.

    python benchmarks/bench_moe_kept.py [--rounds 20] [--repeats 3] [--tokens 16] [--dequantized-per-step]
        [--skip-layer] [--skip-engine] [--a8-only]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from bench_quantized_decode import EngineSystem  # noqa: E402
from quant_checkpoints import ct_compress, ct_scheme, float_weights, write_checkpoint  # noqa: E402

from kubeinfer.engine.model_executor.layers.fused_moe import a8_experts  # noqa: E402
from kubeinfer.engine.model_executor.layers.fused_moe.activation import silu_and_mul  # noqa: E402
from kubeinfer.engine.model_executor.layers.fused_moe.grouped import grouped_experts  # noqa: E402
from kubeinfer.engine.model_executor.layers.quantization.expert_input_quant import ExpertInputQuant  # noqa: E402
from kubeinfer.engine.model_executor.layers.fused_moe.int_experts import ExpertsIntMethod  # noqa: E402
from kubeinfer.engine.model_executor.layers.fused_moe.layer import FusedMoE  # noqa: E402
from kubeinfer.engine.platforms.cpu.native import a16_method, ops  # noqa: E402
from kubeinfer.engine.model_executor.layers.quantization.linear_method import IntWeight  # noqa: E402
from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402

E, H, INTER, K = 32, 1024, 512, 4
MODEL = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1024, vocab_size=8192,
             num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, max_position_embeddings=512)
SCHEMES = {"w8a16": ("pack-quantized", 8, "int", "channel", True, None),
           "w4a16": ("pack-quantized", 4, "int", "group", True, 128)}
TORCH_KERNEL = {"w8a16": "cpu_int8_bf16", "w4a16": "cpu_int4_bf16"}  # torch's products, forced
A8_SCHEMES = {"w8a8": ("int-quantized", 8, "int", "channel", True, None, True),
              "w4a8": ("pack-quantized", 4, "int", "group", True, 128, True)}
A8_KERNELS = {"w8a8": ("int8_vnni", "int_mm"), "w4a8": ("w4a8_vnni", "w4a8_int_mm")}


def quantized(w: torch.Tensor, bits: int) -> IntWeight:
    """[E, N, K] float to symmetric ints: int8 per row, int4 by groups of 128."""
    group = w.shape[-1] if bits == 8 else 128
    grouped = w.reshape(*w.shape[:-1], -1, group)
    scale = grouped.abs().amax(-1) / (127 if bits == 8 else 7)
    values = (grouped / scale.unsqueeze(-1)).round().clamp(-128 if bits == 8 else -8, 127 if bits == 8 else 7)
    return IntWeight(values.reshape(w.shape).to(torch.int8), scale, None, group, bits)


def layer_rows(rounds: int, dequantized_per_step: bool) -> list[str]:
    torch.set_num_threads(1)
    if ops.available():
        ops.set_threads(1)  # the native pool (the A16 product) on one thread too
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(E, 2 * INTER, H, generator=g) * 0.02, torch.randn(E, H, INTER, generator=g) * 0.02
    runners = {"float32 stacks (dequantized at load)": lambda x, w, ids: grouped_experts(x, gate_up, down, w, ids,
                                                                                           silu_and_mul)}
    for bits in (8, 4):
        ints = {"gate_up": quantized(gate_up, bits), "down": quantized(down, bits)}
        kernels = [f"cpu_int{bits}_bf16"] + ([f"cpu_int{bits}_a16"] if a16_method.fast() else [])
        for kernel in kernels:
            moe = FusedMoE(E, H, INTER)
            moe.int_method = ExpertsIntMethod(moe, ints, kernel, torch.float32)
            runners[f"int{bits} kept, {kernel} per active expert"] = moe.forward
        if not dequantized_per_step:
            continue

        def active_dequantized(x, w, ids, ints=ints):
            def product(which, e, rows, out, bias):
                part = ints[which]
                one = IntWeight(part.values[e], part.scale[e], None, part.group_size, part.bits)
                torch.mm(rows, one.dequantize().t(), out=out)
            return grouped_experts(x, gate_up, down, w, ids, silu_and_mul, products=product)
        runners[f"int{bits} kept, active experts dequantized per step"] = active_dequantized
    return timed(runners, rounds, g, lambda name: "float32 stacks (dequantized at load)")


def timed(runners: dict, rounds: int, g: torch.Generator, base_of) -> list[str]:
    """The table of medians at 1 / 16 / 64 tokens, interleaved rounds; each cell's ratio: its `base_of(name)`
    column's time over its own."""
    lines = ["| tokens | " + " | ".join(runners) + " |", "|---|" + "---|" * len(runners)]
    for tokens in (1, 16, 64):
        x = torch.randn(tokens, H, generator=g)
        weights = torch.softmax(torch.randn(tokens, K, generator=g), -1)
        ids = torch.randint(0, E, (tokens, K), generator=g)
        times = {name: [] for name in runners}
        with torch.inference_mode():
            for r in range(rounds):
                for name in (list(runners) if r % 2 else list(runners)[::-1]):
                    start = time.perf_counter()
                    runners[name](x, weights, ids)
                    times[name].append(time.perf_counter() - start)
        median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        lines.append(f"| {tokens} | " + " | ".join(f"{ms:.2f} ms ({median[base_of(name)] / ms:.2f}x)"
                                                   for name, ms in median.items()) + " |")
        print(lines[-1], f"load {os.getloadavg()[0]:.1f}")
    return lines


def a8_layer_rows(rounds: int) -> list[str]:
    """3.'s layer: per scheme, before (float32 stacks, inputs fake-quantized) and its integer kernels."""
    torch.set_num_threads(1)
    ops.set_threads(1)
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(E, 2 * INTER, H, generator=g) * 0.02, torch.randn(E, H, INTER, generator=g) * 0.02
    token = a8_experts.TOKEN
    runners = {}
    for scheme, bits in (("w8a8", 8), ("w4a8", 4)):
        ints = {"gate_up": quantized(gate_up, bits), "down": quantized(down, bits)}
        before = FusedMoE(E, H, INTER)
        before.gate_up_proj.data, before.down_proj.data = ints["gate_up"].dequantize(), ints["down"].dequantize()
        before.input_quant = ExpertInputQuant(token, token, {})
        runners[f"{scheme} before (float32 stacks, fake-quantized inputs)"] = before.forward
        for kernel in A8_KERNELS[scheme]:
            moe = FusedMoE(E, H, INTER)
            moe.int_method = ExpertsIntMethod(moe, ints, kernel, torch.float32)
            moe.input_quant = ExpertInputQuant(token, token, {})  # as the loader installs it (the products' own)
            runners[f"{scheme} `{kernel}`"] = moe.forward
    return timed(runners, rounds, g, lambda name: next(n for n in runners if n.startswith(name.split()[0])))


def checkpoint(scheme: str, args: tuple) -> Path:
    """2.'s random Qwen3-MoE, and its checkpoint by the compressed-tensors package for `scheme` (made once)."""
    root = Path(".cache")
    float_dir = root / "bench-qwen3-moe-kept"
    if not (float_dir / "config.json").exists():
        build_random_model(float_dir, "qwen3_moe", tokenizer=False, initializer_range=0.02, **MODEL)
    path = root / f"bench-qwen3-moe-kept-{scheme}"
    if not (path / "config.json").exists():
        config = ct_scheme(*args, ignore=("re:.*mlp.gate$",))
        write_checkpoint(float_dir, path, ct_compress(float_weights(float_dir), config), config)
    return path


def engine_rows(repeats: int, tokens: int) -> list[str]:
    systems = {}
    for scheme, args in SCHEMES.items():
        path = checkpoint(scheme, args)
        systems[f"{scheme} kept (default)"] = EngineSystem(path, tokens)
        if a16_method.fast():  # else the default is torch's already
            systems[f"{scheme} kept, torch's (forced)"] = EngineSystem(path, tokens, kernel=TORCH_KERNEL[scheme])
        systems[f"{scheme} dequantized"] = EngineSystem(path, tokens, kernel="dequantized")
    return engine_table(systems, repeats)


def a8_engine_rows(repeats: int, tokens: int) -> list[str]:
    """3.'s engines: the experts' integer kernels (default) and as before (a8_experts.choose off)."""
    systems = {}
    for scheme, args in A8_SCHEMES.items():
        path = checkpoint(scheme, args)
        systems[f"{scheme} (default)"] = EngineSystem(path, tokens)
        with _experts_as_before():
            systems[f"{scheme} before (experts dequantized, inputs fake-quantized)"] = EngineSystem(path, tokens)
    return engine_table(systems, repeats)


@contextlib.contextmanager
def _experts_as_before():
    choose, a8_experts.choose = a8_experts.choose, lambda *args: None
    try:
        yield
    finally:
        a8_experts.choose = choose


def engine_table(systems: dict, repeats: int) -> list[str]:
    torch.set_num_threads(2)
    if ops.available():
        ops.set_threads(ops.default_threads())  # the engine's own (layer_rows set one)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, MODEL["vocab_size"], (32,), generator=gen).tolist() for _ in range(16)]
    for system in systems.values():
        system.rate(prompts[:1])
    rates, loads = {}, []
    for _ in range(repeats):
        for batch in (1, 16):
            for label, system in systems.items():
                rates.setdefault((label, batch), []).append(system.rate(prompts[:batch]))
        loads.append(os.getloadavg()[0])
        print({f"{k[0]} @{k[1]}": f"{max(v):.1f}" for k, v in rates.items()}, f"load {loads[-1]:.1f}")
    lines = [f"load average {min(loads):.1f}-{max(loads):.1f} on 2 cores while measured", "",
             "| checkpoint | experts | weight MiB held (experts MiB) | batch 1 tok/s (best / median) | "
             "batch 16 tok/s (best / median) |", "|---|---|---|---|---|"]
    for label, system in systems.items():
        model = system.llm.engine.runner.model
        held = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
        experts = sum(p.numel() * p.element_size() for m in model.experts_modules().values()
                      for p in m.parameters() if p.device.type != "meta")
        kernels = ", ".join(sorted(set(getattr(model, "expert_kernels", {}).values()))) or "float32 stacks"
        cells = [f"{max(rates[(label, b)]):.1f} / {statistics.median(rates[(label, b)]):.1f}" for b in (1, 16)]
        row = f"| {label} | {kernels} | {held / 2**20:.1f} ({experts / 2**20:.1f}) | "
        lines.append(row + " | ".join(cells) + " |")
    for system in systems.values():
        system.close()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--skip-layer", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--dequantized-per-step", action="store_true",
                        help="also the active experts dequantized to float32 each step (slow: 10-100x the others)")
    parser.add_argument("--a8-only", action="store_true", help="only the W8A8 / W4A8 experts' tables (3.)")
    args = parser.parse_args()
    if not args.skip_layer and not args.a8_only:
        print("\n".join(layer_rows(args.rounds, args.dequantized_per_step)))
    if not args.skip_layer and ops.available():
        print("\n".join(a8_layer_rows(args.rounds)))
    if not args.skip_engine and not args.a8_only:
        print("\n".join(engine_rows(args.repeats, args.tokens)))
    if not args.skip_engine and ops.available():
        print("\n".join(a8_engine_rows(args.repeats, args.tokens)))


if __name__ == "__main__":
    main()
