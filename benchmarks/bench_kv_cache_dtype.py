"""Decode speed by KV cache type on the CPU (`--kv-cache-dtype auto|bfloat16|fp8`), side by side in one run: the
engine's float32 model and its W4A16 checkpoint with an int8 lm_head (bench_quantized_decode.py's models and
systems), each with a float32 (`auto`), bfloat16 and fp8 (e4m3) cache, at batch 1 and 16; beside them llama.cpp
f32 and Q4_0 (output matrix Q8_0) at its default context parameters, whose K/V cache is f16 (type_k / type_v
GGML_TYPE_F16): the `bfloat16` rows are the like-for-like ones (two bytes an element on both sides).

Every system runs --repeats rounds, interleaved within each round (bench_quantized_decode.measure); the best
round is reported with the median beside it, and the load average while measured.

    python benchmarks/bench_kv_cache_dtype.py --model large --peer llama.cpp [--prompt-len 32,256] [--tokens 32]
"""
from __future__ import annotations

import argparse
import statistics

import bench_quantized_decode as bqd
import llama_cpp_peer
from results import update_results

KV_DTYPES = ("auto", "bfloat16", "fp8")
ENGINES = {"float32": "float32", "W4A16, lm_head int8": "w4a16-head8"}  # label -> checkpoints() key
PEERS = {"float32": ("f32", None), "W4A16, lm_head int8": ("Q4_0, output Q8_0", ("Q4_0", "Q8_0"))}


def systems(made: dict, f32_gguf, tokens: int) -> dict:
    out = {}
    for model, key in ENGINES.items():
        for kv in KV_DTYPES:
            out[f"engine {model}, cache {kv}"] = bqd.EngineSystem(made[key], tokens, kv_cache_dtype=kv)
        if f32_gguf is not None:
            name, quant = PEERS[model]
            gguf = f32_gguf if quant is None else llama_cpp_peer.quantize(f32_gguf, quant[0], output=quant[1])
            out[f"llama.cpp {name}, cache f16"] = bqd.LlamaCppSystem(gguf, tokens)
    return out


def peer_cache_type() -> str:
    """llama.cpp's default K cache type, read from its own default parameters (1: GGML_TYPE_F16)."""
    import llama_cpp

    params = llama_cpp.llama_context_default_params()
    names = {0: "f32", 1: "f16", 30: "bf16", 8: "q8_0"}
    return f"{names.get(params.type_k, params.type_k)} / {names.get(params.type_v, params.type_v)}"


def table(rates: dict, loads: list, name: str, peer: bool, prompt_len: int) -> str:
    best = {key: max(v) for key, v in rates.items()}
    lines = [f"**{name}, {prompt_len}-token prompts** (load average {min(loads):.1f}-{max(loads):.1f} on 2 cores while "
             "measured)", "",
             "| system | batch 1 tok/s (best / median) | ms per step | batch 16 tok/s (best / median) | ms per step |",
             "|---|---|---|---|---|"]
    for label in dict.fromkeys(label for label, _ in rates):
        cells = []
        for batch in bqd.BATCHES:
            r = rates[(label, batch)]
            cells += [f"{max(r):.1f} / {statistics.median(r):.1f}", f"{1000 * batch / max(r):.2f}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")

    def ratio(ours: str, theirs: str) -> str:
        return ", ".join(f"batch {b} {best[(ours, b)] / best[(theirs, b)]:.2f}x" for b in bqd.BATCHES)
    for model in ENGINES:
        for kv in KV_DTYPES[1:]:
            lines.append(f"- engine {model}: cache {kv} / cache auto (float32): "
                         f"{ratio(f'engine {model}, cache {kv}', f'engine {model}, cache auto')} (best rounds)")
        if peer:
            theirs = f"llama.cpp {PEERS[model][0]}, cache f16"
            for kv in ("bfloat16", "auto"):
                lines.append(f"- engine {model}, cache {kv} / {theirs}: {ratio(f'engine {model}, cache {kv}', theirs)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="large", choices=list(bqd.MODELS))
    parser.add_argument("--prompt-len", default=str(bqd.PROMPT_LEN), help="prompt tokens per request, comma-separated")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per system, interleaved")
    parser.add_argument("--peer", choices=("llama.cpp",), help="also run llama.cpp f32 and Q4_0 (f16 cache)")
    parser.add_argument("--llama-cpp-converter", default=llama_cpp_peer.default_converter(),
                        help="llama.cpp's convert_hf_to_gguf.py (default: $LLAMA_CPP_CONVERTER)")
    args = parser.parse_args()
    made = bqd.checkpoints(args.model, "int8")
    args.lm_head = "int8"
    f32_gguf, peer_note = bqd.llama_cpp_f32(made, args)
    tables = []
    for prompt_len in [int(n) for n in args.prompt_len.split(",")]:
        bqd.PROMPT_LEN = prompt_len  # measure() and llama.cpp's contexts read it
        rates, _, _, loads = bqd.measure(args.model, systems(made, f32_gguf, args.tokens), args)
        tables.append(table(rates, loads, args.model, f32_gguf is not None, prompt_len))
    body = "\n".join([
        f"Command: `python benchmarks/bench_kv_cache_dtype.py --model {args.model} --prompt-len {args.prompt_len} "
        f"--tokens {args.tokens} --repeats {args.repeats}" + (f" --peer {args.peer}" if args.peer else "") + "`. "
        + bqd.command_and_machine(args, "").split(". ", 1)[1],
        f"{args.prompt_len}-token prompts (one table each), {args.tokens} tokens greedy; aggregate decode tokens/s "
        f"from the last first token to the last token; {args.repeats} rounds, systems interleaved; best and median "
        "round. The engine's "
        "W4A16 checkpoint: int4 groups of 128 and lm_head W8A16 per channel (compressed-tensors package), the "
        "default A16 products, the fused native decoder layers for every cache type; the float32 model: its "
        "per-module path with the native decode attention. llama.cpp: its default context parameters, K/V cache "
        + (f"{peer_cache_type()} (llama_context_default_params)." if f32_gguf is not None else "(not run)."), "",
        *[t + "\n" for t in tables]] + ([f"- {peer_note}"] if peer_note else []))
    update_results("kv-cache-16bit", "KV cache type: decode at batch 1 and 16 with a float32, bfloat16 and fp8 "
                   "cache, against llama.cpp's f16 cache (CPU)", body)


if __name__ == "__main__":
    main()
