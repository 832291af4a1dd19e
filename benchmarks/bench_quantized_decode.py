"""Decode speed of quantized weights on the CPU, side by side in one run on the same model: the engine at batch 1
and batch 16 with the float32 checkpoint (the CPU default) and compressed-tensors W8A16 (int8 per channel) and
W4A16 (int4, groups of 128) checkpoints of it, kept quantized (layers/quantization/linear_method.py: on a float32
model torch's weight-only products with bf16 activations; KUBEINFER_QUANT_KERNEL picks another kernel), against
llama.cpp f32, Q8_0 and Q4_0 of the same weights (`--peer llama.cpp`; llama_cpp_peer.py says exactly how it is
run and what it needs: without it the rows are skipped with instructions). Also: the time a step spends in its
matrix products alone (every projection of the engine's loaded model through its own kernel, back to back, in
the engine's small-step threading), and the KV cache's capacity with --kv-cache-dtype fp8 against bf16.

Models (random-init Llamas built here; the checkpoints written by the `compressed-tensors` package, the test
extra): `small`, the 33.6M model of the throughput benchmark, where a step is mostly per-step overhead rather
than weight reads; `large`, 222M parameters (hidden 1024, 12 layers), where the weights dominate. Every
system runs --repeats rounds, the systems interleaved within each round; the best round is reported (the
machine is shared: the best round is the one least disturbed), with the median beside it.

    python benchmarks/bench_quantized_decode.py --model small,large --peer llama.cpp [--tokens 32] [--repeats 3]
    python benchmarks/bench_quantized_decode.py --kernels     # one layer's product per kernel (the CPU choice)

`--scheme w4a8`: a W4A8 checkpoint (int4 weights, int8 per-token activations) against llama.cpp Q4_0 instead
(bench_w4a8_decode.py, its own RESULTS.md section quantized-decode-w4a8).

`--lm-head int8`: the checkpoints quantize lm_head too, W8A16 per channel in both (a config group of its own; as
llama.cpp users' Q8_0 output matrix), and llama.cpp's Q8_0/Q4_0 quantize their output matrix to Q8_0; the
float-head checkpoints and f32-output GGUFs run beside them in the same rounds. Written to its own RESULTS.md
section (quantized-decode-lmhead).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# as the `kubeinfer` command does (kubeinfer/cli.py), before numpy loads OpenBLAS: small steps share the cores
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import llama_cpp_peer  # noqa: E402
from bench_quantized_kernels import kernel_times  # noqa: E402
from bench_throughput import MODEL_SHAPE  # noqa: E402
from quant_checkpoints import (  # noqa: E402
    HEAD_W8A16,
    ct_compress,
    ct_scheme,
    ct_with_quantized_head,
    float_weights,
    write_checkpoint,
)
from results import update_results  # noqa: E402

from kubeinfer.engine import LLM, SamplingParams  # noqa: E402
from kubeinfer.engine.platforms.cpu import cpu_blas  # noqa: E402
from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402

PROMPT_LEN = 32
BATCHES = (1, 16)
MODELS = {"small": ("bench-llama-33m", MODEL_SHAPE),
          "large": ("bench-llama-222m", dict(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=8,
                                             intermediate_size=4096, vocab_size=16384, max_position_embeddings=1024))}
SCHEMES = {"w8a16": ("pack-quantized", 8, "int", "channel", True, None),
           "w4a16": ("pack-quantized", 4, "int", "group", True, 128)}


def checkpoints(name: str, lm_head: str = "float32") -> dict[str, Path]:
    """The float32 model and its W8A16 / W4A16 checkpoints, built once under .cache; `lm_head` int8: also their
    copies with lm_head quantized W8A16 per channel (`w8a16-head8`, `w4a16-head8`)."""
    directory, shape = MODELS[name]
    root = Path(".cache")
    made = {"float32": root / directory}
    if not (made["float32"] / "config.json").exists():
        build_random_model(made["float32"], "llama", tokenizer=False, initializer_range=0.02, **shape)
    for scheme, args in SCHEMES.items():
        made[scheme] = root / f"{directory}-{scheme}"
        if not (made[scheme] / "config.json").exists():
            config = ct_scheme(*args)
            write_checkpoint(made["float32"], made[scheme], ct_compress(float_weights(made["float32"]), config),
                             config)
        if lm_head == "int8":
            made[f"{scheme}-head8"] = root / f"{directory}-{scheme}-lmhead-int8"
            if not (made[f"{scheme}-head8"] / "config.json").exists():
                write_checkpoint(made["float32"], made[f"{scheme}-head8"],
                                 *ct_with_quantized_head(float_weights(made["float32"]), ct_scheme(*args), HEAD_W8A16))
    return made


class EngineSystem:
    """One engine (max_num_seqs 16) that runs a round at any batch size up to 16."""

    def __init__(self, path: Path, tokens: int, kernel: str | None = None, kv_cache_dtype: str = "auto") -> None:
        if kernel:
            os.environ["KUBEINFER_QUANT_KERNEL"] = kernel
        try:
            self.llm = LLM(str(path), max_num_seqs=max(BATCHES), enable_prefix_caching=False,
                           num_kv_blocks=64 * max(BATCHES), kv_cache_dtype=kv_cache_dtype)
        finally:
            os.environ.pop("KUBEINFER_QUANT_KERNEL", None)
        self.tokens, self.rounds = tokens, 0
        model = self.llm.engine.runner.model
        self.kernels = sorted(set(getattr(model, "quant_kernels", {}).values())) or ["float32"]

    def rate(self, prompts: list[list[int]]) -> float:
        """Aggregate decode tokens/s: from the last first token to the last token."""
        engine, self.rounds = self.llm.engine, self.rounds + 1
        params = SamplingParams(temperature=0, max_tokens=self.tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{self.rounds}-{i}", list(prompt), params)
        done = []
        while engine.has_unfinished_requests():
            done += [o.metrics for o in engine.step() if o.finished]
        start, end = max(m["first_token_time"] for m in done), max(m["last_token_time"] for m in done)
        return len(prompts) * (self.tokens - 1) / (end - start)

    def products_ms(self, batch: int, calls: int = 3) -> float:
        """ms of one step's matrix products alone: every projection and lm_head of the loaded model through its own
        forward (kept-quantized kernel, OpenBLAS or torch), back to back, in a decode step's threading."""
        model = self.llm.engine.runner.model
        layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        inputs = [torch.rand(batch, m.in_features) for m in layers]
        times = []
        share = any(k.startswith("cpu_int") for k in getattr(model, "quant_kernels", {}).values())  # as model_runner
        with torch.inference_mode(), cpu_blas.small_step(getattr(model, "openblas_small_steps", False), share):
            for _ in range(calls + 1):
                start = time.perf_counter()
                for layer, x in zip(layers, inputs):
                    layer(x)
                times.append(time.perf_counter() - start)
        return min(times[1:]) * 1e3

    def close(self) -> None:
        self.llm.shutdown()


class LlamaCppSystem:
    def __init__(self, gguf: Path, tokens: int) -> None:
        self.decoder = llama_cpp_peer.BatchedDecoder(gguf, torch.get_num_threads(), PROMPT_LEN, tokens)
        self.rate = self.decoder.rate
        self.decoder.rate([[11] * PROMPT_LEN])  # warm-up (page faults, repacking)

    def close(self) -> None:
        self.decoder.close()


def head_systems(made: dict[str, Path], tokens: int) -> dict:
    """--lm-head int8: the int8-head checkpoints (default A16 product, and llama.cpp's arithmetic) beside the same
    models with a float32 head."""
    return {"engine W8A16, lm_head int8": EngineSystem(made["w8a16-head8"], tokens),
            "engine W4A16, lm_head int8": EngineSystem(made["w4a16-head8"], tokens),
            "engine W8A16, lm_head float32": EngineSystem(made["w8a16"], tokens),
            "engine W4A16, lm_head float32": EngineSystem(made["w4a16"], tokens),
            "engine W8A16, lm_head int8, llama.cpp arithmetic": EngineSystem(made["w8a16-head8"], tokens,
                                                                             "cpu_int8_vnni"),
            "engine W4A16, lm_head int8, llama.cpp arithmetic": EngineSystem(made["w4a16-head8"], tokens,
                                                                             "cpu_int4_vnni")}


HEAD_PAIRS = (("engine W8A16, lm_head int8", "llama.cpp Q8_0, output Q8_0"),
              ("engine W4A16, lm_head int8", "llama.cpp Q4_0, output Q8_0"),
              ("engine W8A16, lm_head int8, llama.cpp arithmetic", "llama.cpp Q8_0, output Q8_0"),
              ("engine W4A16, lm_head int8, llama.cpp arithmetic", "llama.cpp Q4_0, output Q8_0"),
              ("engine W8A16, lm_head float32", "llama.cpp Q8_0, output f32"),
              ("engine W4A16, lm_head float32", "llama.cpp Q4_0, output f32"),
              ("engine W8A16, lm_head int8", "engine W8A16, lm_head float32"),
              ("engine W4A16, lm_head int8", "engine W4A16, lm_head float32"))


def run_model(name: str, args) -> str:
    """The side-by-side table of one model (markdown), printed as it goes."""
    made = checkpoints(name, args.lm_head)
    systems = head_systems(made, args.tokens) if args.lm_head == "int8" else {
               "engine float32 checkpoint (float32)": EngineSystem(made["float32"], args.tokens),
               "engine W8A16 (float32 model)": EngineSystem(made["w8a16"], args.tokens),
               "engine W4A16 (float32 model)": EngineSystem(made["w4a16"], args.tokens),
               # the previous default: torch's weight-only products, activations and dequantized weights bf16
               "engine W8A16, torch bf16 product": EngineSystem(made["w8a16"], args.tokens, "cpu_int8_bf16"),
               "engine W4A16, torch bf16 product": EngineSystem(made["w4a16"], args.tokens, "cpu_int4_bf16"),
               # opt-in: llama.cpp's arithmetic (Q8_0 activations) through the native VNNI kernels (cpu_native/)
               "engine W8A16, llama.cpp arithmetic": EngineSystem(made["w8a16"], args.tokens, "cpu_int8_vnni"),
               "engine W4A16, llama.cpp arithmetic": EngineSystem(made["w4a16"], args.tokens, "cpu_int4_vnni")}
    f32, peer_note = llama_cpp_f32(made, args)
    if f32 is not None and args.lm_head == "int8":
        for kind in ("Q8_0", "Q4_0"):
            for output in ("Q8_0", "F32"):
                systems[f"llama.cpp {kind}, output {output.replace('F32', 'f32')}"] = LlamaCppSystem(
                    llama_cpp_peer.quantize(f32, kind, output=output), args.tokens)
    elif f32 is not None:
        systems["llama.cpp f32"] = LlamaCppSystem(f32, args.tokens)
        for kind in ("Q8_0", "Q4_0"):
            systems[f"llama.cpp {kind}"] = LlamaCppSystem(llama_cpp_peer.quantize(f32, kind), args.tokens)
    rates, products, kernels, loads = measure(name, systems, args)
    return table(name, rates, products, kernels, loads, peer_note, HEAD_PAIRS if args.lm_head == "int8" else None)


def llama_cpp_f32(made: dict, args) -> tuple[Path | None, str]:
    """With --peer: llama.cpp's f32 GGUF of the float32 checkpoint (its quantizations are made from it), or None and
    the note saying what to install where llama.cpp is missing (printed); without: (None, "")."""
    if not args.peer:
        return None, ""
    why_not = llama_cpp_peer.missing(args.llama_cpp_converter)
    if why_not:
        note = llama_cpp_peer.HOW_TO_INSTALL.format(missing=why_not)
        print(note)
        return None, note
    return llama_cpp_peer.convert(made["float32"], "f32", args.llama_cpp_converter, Path(".cache")), ""


def measure(name: str, systems: dict, args) -> tuple[dict, dict, dict, list]:
    """Every system's rounds, interleaved (then closed): (rates, products alone, kernels, load averages)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, MODELS[name][1]["vocab_size"], (PROMPT_LEN,), generator=gen).tolist()
               for _ in range(max(BATCHES))]
    for system in systems.values():  # warm-up round
        if isinstance(system, EngineSystem):
            system.rate(prompts[:1])
    rates: dict[tuple[str, int], list[float]] = {}
    products: dict[tuple[str, int], float] = {}
    loads = []
    for _ in range(args.repeats):
        for batch in BATCHES:
            for label, system in systems.items():
                rates.setdefault((label, batch), []).append(system.rate(prompts[:batch]))
                if isinstance(system, EngineSystem):  # right after its round, under the same load
                    alone = system.products_ms(batch)
                    products[(label, batch)] = min(products.get((label, batch), alone), alone)
        loads.append(os.getloadavg()[0])
        print(name, {f"{k[0]} @{k[1]}": f"{max(v):.1f}" for k, v in rates.items()}, f"load {loads[-1]:.1f}")
    kernels = {label: ", ".join(s.kernels) for label, s in systems.items() if isinstance(s, EngineSystem)}
    for system in systems.values():
        system.close()
    return rates, products, kernels, loads


def table(name: str, rates, products, kernels, loads, peer_note: str, pairs=None) -> str:
    best = {key: max(v) for key, v in rates.items()}
    params = {"small": "33.6M", "large": "222M"}[name]
    lines = [f"**{name}** ({params} parameters; load average {min(loads):.1f}-{max(loads):.1f} on 2 cores "
             "while measured)", "",
             "| system | kernels | batch 1 tok/s (best / median) | ms per step | products alone ms | "
             "batch 16 tok/s (best / median) | ms per step | products alone ms |", "|---|---|---|---|---|---|---|---|"]
    labels = list(dict.fromkeys(label for label, _ in rates))
    for label in labels:
        cells = []
        for batch in BATCHES:
            r = rates[(label, batch)]
            alone = products.get((label, batch))
            cells += [f"{max(r):.1f} / {statistics.median(r):.1f}", f"{1000 * batch / max(r):.2f}",
                      f"{alone:.2f}" if alone is not None else "-"]
        lines.append(f"| {label} | {kernels.get(label, 'llama.cpp')} | " + " | ".join(cells) + " |")
    lines.append("")
    for ours, theirs in pairs or (("engine W8A16 (float32 model)", "llama.cpp Q8_0"),
                                  ("engine W4A16 (float32 model)", "llama.cpp Q4_0"),
                                  ("engine W8A16, llama.cpp arithmetic", "llama.cpp Q8_0"),
                                  ("engine W4A16, llama.cpp arithmetic", "llama.cpp Q4_0"),
                                  ("engine float32 checkpoint (float32)", "llama.cpp f32")):
        if (theirs, 1) in best and (ours, 1) in best:
            ratios = [best[(ours, b)] / best[(theirs, b)] for b in BATCHES]
            goals = "" if "checkpoint" in ours or theirs.startswith("engine") else (
                f"; issue 29's goals (batch 1 >= 1x, batch 16 >= 1.5x): batch 1 "
                f"{'met' if ratios[0] >= 1 else 'not met'}"
                f", batch 16 {'met' if ratios[1] >= 1.5 else 'not met'}")
            lines.append(f"- {ours} / {theirs}: batch 1 {ratios[0]:.2f}x, batch 16 {ratios[1]:.2f}x (best rounds)"
                         + goals)
    if peer_note:
        lines.append(f"- {peer_note}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per system, interleaved")
    parser.add_argument("--model", default="small,large", help="comma-separated: small, large")
    parser.add_argument("--peer", choices=("llama.cpp",), help="also run llama.cpp f32, Q8_0 and Q4_0")
    parser.add_argument("--llama-cpp-converter", default=llama_cpp_peer.default_converter(),
                        help="llama.cpp's convert_hf_to_gguf.py (default: $LLAMA_CPP_CONVERTER)")
    parser.add_argument("--kernels", action="store_true", help="time one layer's product per kernel instead")
    parser.add_argument("--lm-head", choices=("float32", "int8"), default="float32",
                        help="int8: checkpoints with lm_head W8A16 per channel against llama.cpp's Q8_0 output "
                             "matrix (its own RESULTS.md section)")
    parser.add_argument("--scheme", choices=("w4a8",), help="w4a8: a W4A8 checkpoint (int4 weights, int8 activations) "
                        "against llama.cpp Q4_0 instead (bench_w4a8_decode.py; its own RESULTS.md section)")
    args = parser.parse_args()
    if args.scheme == "w4a8":
        from bench_w4a8_decode import run

        run(args)
        return
    if args.kernels:
        kernel_times()
        return
    models = args.model.split(",")
    unknown = set(models) - set(MODELS)
    if unknown:
        parser.error(f"unknown --model {', '.join(sorted(unknown))}; choose from {', '.join(MODELS)}")
    tables = [run_model(name, args) for name in models]
    if args.lm_head == "int8":
        write_head_section(args, tables)
        return
    budget = 64 << 20
    blocks = {kv: LLM(str(checkpoints(models[0])["float32"]), dtype="bfloat16", kv_cache_dtype=kv,
                      kv_cache_memory_bytes=budget, max_num_seqs=4096).engine.num_kv_blocks for kv in ("auto", "fp8")}
    body = "\n".join([
        command_and_machine(args, "", " (built here, native AVX-512 VNNI)"),
        f"Same weights and token ids on both sides: W8A16/W4A16 written by the compressed-tensors package from the "
        f"float32 model; llama.cpp's f32 GGUF by its converter, Q8_0/Q4_0 by its quantizer from that f32 GGUF with "
        f"the output matrix kept f32 as the checkpoints keep lm_head (llama_cpp_peer.py). {PROMPT_LEN}-token prompts, "
        f"{args.tokens} tokens greedy; aggregate decode tokens/s from the last first token to the last token; "
        f"{args.repeats} rounds, systems interleaved; best and median round. 'products alone': one step's "
        "projections and lm_head through the engine's own layers, back to back (the rest of the step is the "
        "difference to 'ms per step'; each timed right after the system's round, the best kept).", "",
        *[t + "\n" for t in tables],
        f"KV capacity in {budget >> 20} MiB (bf16 model): {blocks['auto']} blocks with the bf16 cache, {blocks['fp8']} "
        f"with `--kv-cache-dtype fp8` ({blocks['fp8'] / blocks['auto']:.2f}x)."])
    update_results("quantized-decode", "Quantized weights: decode at batch 1 and 16 against llama.cpp (CPU)", body)


def command_and_machine(args, flags: str, llama_cpp_build: str = "") -> str:
    """The section's first sentence: the command that wrote it and the machine it ran on."""
    peer = args.peer and not llama_cpp_peer.missing(args.llama_cpp_converter)
    return (f"Command: `python benchmarks/bench_quantized_decode.py {flags}--model {args.model} --tokens {args.tokens} "
            f"--repeats {args.repeats}" + (f" --peer {args.peer}" if args.peer else "") + "`. "
            f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs (load below), torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads for the engine and for llama.cpp"
            + (f", llama-cpp-python {llama_cpp_peer.version()}{llama_cpp_build}" if peer else "") + ".")


def write_head_section(args, tables: list[str]) -> None:
    body = "\n".join([
        command_and_machine(args, "--lm-head int8 "),
        "lm_head quantized on both sides: the W8A16 and W4A16 checkpoints (compressed-tensors package) with lm_head "
        "W8A16 per channel in a config group of its own (the decoder as in quantized-decode); llama.cpp's Q8_0 and "
        "Q4_0 quantized from its f32 GGUF with `output_tensor_type` Q8_0 (llama_cpp_peer.quantize). The same "
        "models with a float32 head / f32 output matrix run in the same rounds, interleaved. "
        f"{PROMPT_LEN}-token prompts, {args.tokens} tokens greedy; aggregate decode tokens/s from the last first "
        f"token to the last token; {args.repeats} rounds; best and median round; 'products alone' as in "
        "quantized-decode.", "", *[t + "\n" for t in tables]])
    update_results("quantized-decode-lmhead", "Quantized lm_head: decode at batch 1 and 16 against llama.cpp with "
                   "a Q8_0 output matrix (CPU)", body)


if __name__ == "__main__":
    main()
