"""Decode speed of quantized weights on the CPU: the engine at batch 1 and batch 16 with the float32 checkpoint
(the CPU default), the bf16 one, and compressed-tensors W8A16 (int8 per channel) and W4A16 (int4, groups of
128) checkpoints of the same model, kept quantized through torch's weight-only products
(layers/quantization/linear_method.py; KUBEINFER_QUANT_KERNEL picks the kernel), plus the KV cache's capacity
with --kv-cache-dtype fp8 against bf16 in the same bytes. The checkpoints are written by the
`compressed-tensors` package (the test extra). llama.cpp Q8_0/Q4_0 rows need llama-cpp-python, which is not
installed here (it builds from source): see bench_decode_roofline.py --peer llama.cpp.

    python benchmarks/bench_quantized_decode.py [--tokens 64] [--repeats 3]
    python benchmarks/bench_quantized_decode.py --kernels     # one layer's product per kernel (the CPU choice)
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from bench_throughput import MODEL_SHAPE  # noqa: E402
from quant_checkpoints import ct_compress, ct_scheme, float_weights, write_checkpoint  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.engine import LLM, SamplingParams  # noqa: E402
from kubeinfer.testing.random_model import build_random_model  # noqa: E402

PROMPT_LEN = 32


def decode_rate(model_dir: str, dtype: str, kernel: str | None, batch: int, tokens: int, repeats: int) -> float:
    """Median aggregate decode tokens/s of `batch` requests at once, from the last first token to the end."""
    if kernel:
        os.environ["KUBEINFER_QUANT_KERNEL"] = kernel
    try:
        llm = LLM(model_dir, dtype=dtype, max_num_seqs=batch, enable_prefix_caching=False, num_kv_blocks=64 * batch)
    finally:
        os.environ.pop("KUBEINFER_QUANT_KERNEL", None)
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, MODEL_SHAPE["vocab_size"], (PROMPT_LEN,), generator=gen).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    rates = []
    for r in range(repeats + 1):  # the first round warms up
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{r}-{i}", prompt, params)
        done = []
        while engine.has_unfinished_requests():
            done += [o.metrics for o in engine.step() if o.finished]
        start, end = max(m["first_token_time"] for m in done), max(m["last_token_time"] for m in done)
        if r:
            rates.append(batch * (tokens - 1) / (end - start))
    return statistics.median(rates)


def kernel_times(out: int = 8192, cols: int = 2048, calls: int = 30) -> None:
    """Median ms of one [tokens, 2048] x [8192, 2048] product: F.linear against torch's weight-only int8 and int4
    (group 128) products, float32 and bf16 activations: what linear_method.choose_kernel is based on."""
    import time

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out, cols, generator=gen)
    q8 = torch.randint(-128, 128, (out, cols), generator=gen, dtype=torch.int8)
    q4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (out, cols), generator=gen,
                                                                          dtype=torch.int32), 1)
    lines = ["| activations | tokens | `F.linear` ms | `_weight_int8pack_mm` ms | `_weight_int4pack_mm_for_cpu` ms |",
             "|---|---|---|---|---|"]
    for dtype in (torch.float32, torch.bfloat16):
        w, scale = weight.to(dtype), torch.rand(out, dtype=dtype)
        scales_zeros = torch.rand(cols // 128, out, 2, generator=gen).to(dtype)
        for tokens in (1, 16):
            x = torch.randn(tokens, cols, generator=gen).to(dtype)
            row = [median_ms(lambda: torch.nn.functional.linear(x, w)),
                   median_ms(lambda: torch.ops.aten._weight_int8pack_mm(x, q8, scale)),
                   median_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4, 128, scales_zeros))]
            print(dtype, tokens, " ".join(f"{t:.2f}" for t in row))
            lines.append(f"| {str(dtype).removeprefix('torch.')} | {tokens} | " + " | ".join(f"{t:.2f}" for t in row) + " |")
    body = "\n".join([f"Command: `python benchmarks/bench_quantized_decode.py --kernels`. Machine: {platform.machine()}, "
                      f"{os.cpu_count()} cores (shared with other jobs while measured), torch {torch.__version__}, "
                      f"{torch.get_num_threads()} threads. One [tokens, {cols}] x [{out}, {cols}] product, median of "
                      f"{calls} calls.", "", *lines, "",
                      "The engine's choice on the CPU (layers/quantization/linear_method.py) follows: float32 models "
                      "keep int weights dequantized; bf16 models run int4 through torch's product."])
    update_results("quantized-kernels", "Quantized weights: one layer's product per CPU kernel", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", action="store_true", help="time one layer's product per kernel instead")
    args = parser.parse_args()
    if args.kernels:
        kernel_times()
        return
    root = Path(".cache")
    model_dir = root / "bench-llama-33m"  # the model of bench_throughput.py, built the same way
    if not (model_dir / "config.json").exists():
        build_random_model(model_dir, "llama", tokenizer=False, initializer_range=0.02, **MODEL_SHAPE)
    checkpoints = {}
    for name, scheme in (("w8a16", ("pack-quantized", 8, "int", "channel", True, None)),
                         ("w4a16", ("pack-quantized", 4, "int", "group", True, 128))):
        target = root / f"bench-llama-33m-{name}"
        if not (target / "config.json").exists():
            config = ct_scheme(*scheme)
            write_checkpoint(model_dir, target, ct_compress(float_weights(model_dir), config), config)
        checkpoints[name] = str(target)
    systems = [  # (row, checkpoint, dtype, kernel)
        ("float32 checkpoint, float32 (CPU default)", str(model_dir), "float32", None),
        ("float32 checkpoint, bf16", str(model_dir), "bfloat16", None),
        ("W8A16, bf16, int8 kept (`_weight_int8pack_mm`)", checkpoints["w8a16"], "bfloat16", "cpu_int8"),
        ("W8A16, bf16, dequantized (its default)", checkpoints["w8a16"], "bfloat16", None),
        ("W4A16, bf16, int4 kept (`_weight_int4pack_mm_for_cpu`, its default)", checkpoints["w4a16"], "bfloat16", None),
        ("W8A16, float32, int8 kept (not chosen)", checkpoints["w8a16"], "float32", "cpu_int8"),
        ("W4A16, float32, int4 kept (not chosen)", checkpoints["w4a16"], "float32", "cpu_int4"),
    ]
    rows = []
    for name, path, dtype, kernel in systems:
        one = decode_rate(path, dtype, kernel, 1, args.tokens, args.repeats)
        sixteen = decode_rate(path, dtype, kernel, 16, args.tokens, args.repeats)
        print(f"{name:70s} {one:7.1f} {sixteen:8.1f} tok/s")
        rows.append((name, one, sixteen))
    base1, base16 = rows[0][1], rows[0][2]
    budget = 64 << 20
    blocks = {kv: LLM(str(model_dir), dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory_bytes=budget,
                      max_num_seqs=4096).engine.num_kv_blocks for kv in ("auto", "fp8")}
    table = ["| system | batch 1 tok/s | vs float32 | batch 16 tok/s | vs float32 |", "|---|---|---|---|---|"]
    table += [f"| {n} | {a:.1f} | {a / base1:.2f}x | {b:.1f} | {b / base16:.2f}x |" for n, a, b in rows]
    body = "\n".join([
        f"Command: `python benchmarks/bench_quantized_decode.py --tokens {args.tokens} --repeats {args.repeats}`. "
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other jobs while measured), torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads.",
        f"Model: the random-init Llama of the throughput benchmark; W8A16/W4A16 written by the compressed-tensors "
        f"package. {PROMPT_LEN}-token prompts, {args.tokens} tokens greedy; aggregate decode rate, median of "
        f"{args.repeats}. llama.cpp Q8_0/Q4_0: not measured (llama-cpp-python is not installed and builds from "
        "source here). The machine was shared with other jobs (load 8-15 on 2 cores): rows were measured at "
        "different moments, so differences under about 2x are noise; rerun on a quiet machine.", "", *table, "",
        f"KV capacity in {budget >> 20} MiB (bf16 model): {blocks['auto']} blocks with the bf16 cache, {blocks['fp8']} "
        f"with `--kv-cache-dtype fp8` ({blocks['fp8'] / blocks['auto']:.2f}x)."])
    update_results("quantized-decode", "Quantized weights: decode at batch 1 and 16 (CPU)", body)


if __name__ == "__main__":
    main()
