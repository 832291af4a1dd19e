"""`bench_quantized_decode.py --scheme w4a8`: decode of a compressed-tensors W4A8 checkpoint (llm-compressor's W4A8:
int4 weights, symmetric, groups of 128; int8 dynamic per-token activations) at batch 1 and 16, side by side in one
run on the same model: the engine's exact int4 x int8 product (layers/quantization/w4a8.py, the default), the path
before it (KUBEINFER_W8A8_KERNEL=fake_quant: the weight dequantized to float32, the input fake-quantized, as the
reference computes), the W4A16 checkpoint of the same weights (the float32 default, the exact A16 product) and
llama.cpp Q4_0 (its activations quantized to 8 bits per block of 32: the same-bit-width peer). Written to its own
RESULTS.md section (quantized-decode-w4a8).

    python benchmarks/bench_quantized_decode.py --scheme w4a8 --model large --peer llama.cpp [--repeats 3]
"""
from __future__ import annotations

import os
from pathlib import Path

import llama_cpp_peer
from bench_quantized_decode import (
    BATCHES,
    MODELS,
    PROMPT_LEN,
    EngineSystem,
    LlamaCppSystem,
    checkpoints,
    command_and_machine,
    llama_cpp_f32,
    measure,
    table,
)
from quant_checkpoints import ct_compress, ct_scheme, float_weights, write_checkpoint
from results import update_results

W4A8 = ("pack-quantized", 4, "int", "group", True, 128)  # with int8 dynamic per-token symmetric input activations
PAIRS = (("engine W4A8 (exact int4 x int8 product)", "llama.cpp Q4_0"),
         ("engine W4A8 (exact int4 x int8 product)", "engine W4A8, before (fake-quantized, float32 weights)"),
         ("engine W4A16 (float32 model)", "llama.cpp Q4_0"))


def w4a8_checkpoint(name: str) -> Path:
    made = checkpoints(name)
    path = Path(".cache") / f"{MODELS[name][0]}-w4a8"
    if not (path / "config.json").exists():
        config = ct_scheme(*W4A8, activations=True)
        write_checkpoint(made["float32"], path, ct_compress(float_weights(made["float32"]), config), config)
    return path


class W4A8System(EngineSystem):
    """An engine on the W4A8 checkpoint under KUBEINFER_W8A8_KERNEL=`kernel` (None: the default); the kernels named
    are the activation schemes' (w8a8.py)."""

    def __init__(self, path: Path, tokens: int, kernel: str | None = None) -> None:
        if kernel:
            os.environ["KUBEINFER_W8A8_KERNEL"] = kernel
        try:
            super().__init__(path, tokens)
        finally:
            os.environ.pop("KUBEINFER_W8A8_KERNEL", None)
        schemes = getattr(self.llm.engine.runner.model, "activation_schemes", {})
        self.kernels = sorted(set(schemes.values())) or self.kernels


def run(args) -> None:
    tables = []
    for name in args.model.split(","):
        path, made = w4a8_checkpoint(name), checkpoints(name)
        systems = {"engine W4A8 (exact int4 x int8 product)": W4A8System(path, args.tokens),
                   "engine W4A8, before (fake-quantized, float32 weights)": W4A8System(path, args.tokens,
                                                                                       "fake_quant"),
                   "engine W4A16 (float32 model)": EngineSystem(made["w4a16"], args.tokens)}
        f32, peer_note = llama_cpp_f32(made, args)
        if f32 is not None:
            systems["llama.cpp Q4_0"] = LlamaCppSystem(llama_cpp_peer.quantize(f32, "Q4_0"), args.tokens)
        rates, products, kernels, loads = measure(name, systems, args)
        tables.append(table(name, rates, products, kernels, loads, peer_note, PAIRS))
    body = "\n".join([
        command_and_machine(args, "--scheme w4a8 ", " (built here, native AVX-512 VNNI)"),
        "W4A8 written by the compressed-tensors package from the float32 model (int4 symmetric, groups of 128; int8 "
        "dynamic per-token symmetric input activations; lm_head float); W4A16 the same weights without activation "
        "quantization; llama.cpp Q4_0 by its quantizer from its f32 GGUF of the same model, output matrix f32 "
        f"(llama_cpp_peer.py). {PROMPT_LEN}-token prompts, {args.tokens} tokens greedy, batches {BATCHES}; aggregate "
        f"decode tokens/s from the last first token to the last token; {args.repeats} rounds, systems interleaved; "
        "best and median round; 'products alone' as in quantized-decode.", "", *[t + "\n" for t in tables]])
    update_results("quantized-decode-w4a8", "W4A8 (int4 weights, int8 activations): decode at batch 1 and 16 "
                   "against llama.cpp Q4_0 (CPU)", body)
