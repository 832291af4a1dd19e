"""The GPU benchmark: kubeinfer's engine (triton attention backend, bf16) vs transformers on the same GPU.

On a random-init model of a real shape (Llama-3.2-1B by default; Llama-3-8B with --shape llama-3-8b):
  * decode tokens/s at batch 1, against the HBM roofline (bytes read per step / copy bandwidth measured
    in this run), and transformers `generate` at batch 1; the same with `enforce_eager` (no CUDA graphs);
  * offline throughput at 64-256 concurrent sequences, and transformers `generate` (one static batch)
    and `generate_batch` (its continuous batching, where this transformers has it) on the same requests;
  * TTFT and inter-token latency under Poisson arrivals at several request rates (engine only);
  * multi-LoRA: random rank-16 adapters on all seven projections, mixed round-robin in one batch,
    against the base model in the same engine, with CUDA graphs and without.
Results go to benchmarks/RESULTS.md with the GPU named. Without CUDA it refuses; `--smoke` runs every
path on the CPU with a tiny model (no results written), so the script itself can be checked anywhere.

    python benchmarks/bench_gpu.py [--shape llama-3.2-1b] [--batch-sizes 64,128,256]   # `make bench-gpu`
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from results import update_results  # noqa: E402

from kubeinfer.engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from kubeinfer.dev.testing.random_model import build_random_adapter, build_random_model  # noqa: E402

LORA_RANK = 16
LLAMA3 = dict(vocab_size=128256, max_position_embeddings=4096, rope_theta=500000.0)
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                         tie_word_embeddings=True, **LLAMA3),
    "llama-3-8b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                       **LLAMA3),
    "smoke": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512),
}


def build_model(shape: str, dtype: torch.dtype) -> Path:
    model_dir = Path(".cache") / f"bench-gpu-{shape}"
    if not (model_dir / "config.json").exists():
        print(f"building a random-init {shape} in {model_dir} (once)")
        build_random_model(model_dir, "llama", tokenizer=False, initializer_range=0.02, dtype=dtype, **SHAPES[shape])
    return model_dir


def copy_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once): the roofline's bandwidth."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def decode_bytes_per_token(model_dir: Path, dtype: torch.dtype, context: int) -> float:
    """What one batch-1 decode step must read: every weight but the embedding table (one row of it), plus
    the KV cache of the context."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    element = torch.empty((), dtype=dtype).element_size()
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * inter + 2 * h
    weights = layers * per_layer + h + cfg.vocab_size * h  # + final norm + lm_head (the tied table, read once)
    kv_cache = 2 * layers * context * kv
    return (weights + kv_cache) * element


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def engine_decode_rate(llm: LLM, prompt: list[int], output_len: int) -> float:
    out = llm.generate([{"prompt_token_ids": prompt}], greedy(output_len))[0]
    return (output_len - 1) / (out.metrics["last_token_time"] - out.metrics["first_token_time"])


def engine_throughput(llm: LLM, prompts: list[list[int]], output_len: int, loras=None) -> float:
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(output_len), lora_request=loras)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return len(prompts) * output_len / elapsed


def engine_latency_at_rate(llm: LLM, rate: float, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    """Poisson arrivals at `rate` requests/s into the engine's step loop, as a server would feed it."""
    engine, rng = llm.engine, random.Random(7)
    arrivals, t = [], 0.0
    for _ in prompts:
        t += rng.expovariate(rate)
        arrivals.append(t)
    done, submitted, start = [], 0, time.perf_counter()
    while submitted < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while submitted < len(prompts) and arrivals[submitted] <= now:
            engine.add_request(f"{tag}-{submitted}", {"prompt_token_ids": prompts[submitted]}, greedy(output_len))
            submitted += 1
        if engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        else:
            time.sleep(min(arrivals[submitted] - now, 0.005))
    ttft = sorted(o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in done)
    itl = [(o.metrics["last_token_time"] - o.metrics["first_token_time"]) / (output_len - 1) for o in done]
    return dict(ttft_p50=ttft[len(ttft) // 2], ttft_p90=ttft[int(len(ttft) * 0.9)], itl_mean=statistics.fmean(itl))


def hf_generate_seconds(hf, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, eos_token_id=[], pad_token_id=0)
    _sync(device)
    return time.perf_counter() - start


def hf_generate_batch_rate(hf, prompts: list[list[int]], output_len: int) -> float | None:
    try:
        from transformers import ContinuousBatchingConfig, GenerationConfig
    except ImportError:
        return None
    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    blocks = len(prompts) * -(-(len(prompts[0]) + output_len) // 16) + 64
    cb = ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=4096, **{_page_size_name(): 16})
    start = time.perf_counter()
    hf.generate_batch(prompts, generation_config=config, continuous_batching_config=cb)
    return len(prompts) * output_len / (time.perf_counter() - start)


def _page_size_name() -> str:
    """transformers names the KV page's length `page_size` from 5.18 on, `block_size` before (5.17 on the GPU image)."""
    import inspect

    from transformers import ContinuousBatchingConfig

    names = inspect.signature(ContinuousBatchingConfig).parameters
    return "page_size" if "page_size" in names else "block_size"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=[s for s in SHAPES if s != "smoke"], default="llama-3.2-1b")
    parser.add_argument("--batch-sizes", default="64,128,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--decode-len", type=int, default=256, help="tokens generated in the batch-1 decode run")
    parser.add_argument("--rates", default="4,16,64", help="request rates (req/s) for the latency runs")
    parser.add_argument("--rate-requests", type=int, default=200)
    parser.add_argument("--skip-hf", action="store_true", help="engine figures only")
    parser.add_argument("--skip-eager", action="store_true", help="no batch-1 decode run without CUDA graphs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--lora-adapters", type=int, default=4, help="adapters in the multi-LoRA runs (0: skip them)")
    parser.add_argument("--smoke", action="store_true", help="check every path on the CPU with a tiny model")
    args = parser.parse_args()
    if args.smoke:
        device, dtype, shape = "cpu", torch.float32, "smoke"
        args.batch_sizes, args.prompt_len, args.output_len, args.decode_len = "4,8", 16, 8, 16
        args.rates, args.rate_requests = "50", 8
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_gpu: no CUDA device (torch.cuda.is_available() is False). This benchmark measures the "
                     "GPU path; CPU figures come from `make bench`, and `--smoke` checks this script on the CPU.")
        device, dtype, shape = "cuda", torch.bfloat16, args.shape
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    torch.manual_seed(0)
    model_dir = build_model(shape, dtype)
    vocab = SHAPES[shape]["vocab_size"]
    max_len = args.prompt_len + max(args.output_len, args.decode_len)

    bandwidth = copy_bandwidth(device, nbytes=1 << (24 if args.smoke else 30))
    def engine(**overrides) -> LLM:
        memory = (dict(gpu_memory_utilization=args.gpu_memory_utilization) if device == "cuda"
                  else dict(kv_cache_memory_bytes=64 << 20))
        llm = LLM(str(model_dir), device=device, dtype=str(dtype).removeprefix("torch."), max_model_len=max_len,
                  max_num_seqs=max(batch_sizes), enable_prefix_caching=False,
                  max_num_batched_tokens=max(4096, max(batch_sizes)), **memory, **overrides)
        # Compiles the kernels' variants before timing. Triton specializes integer arguments on divisibility by 16,
        # so one batch of each kind: 17 prompts, and the largest batch (without it the first timed run, 64
        # sequences, paid the compiles: 8-10k tok/s against 30-34k at 128 on the first H200 run).
        for count in (17, max(batch_sizes)):
            warm = random_prompts(count, args.prompt_len, vocab, seed=99)
            llm.generate([{"prompt_token_ids": p} for p in warm], greedy(4))
        return llm

    prompt = random_prompts(1, args.prompt_len, vocab, seed=1)[0]
    eager_decode = None
    if not args.skip_eager:
        llm = engine(enforce_eager=True)
        eager_decode = engine_decode_rate(llm, prompt, args.decode_len)
        print(f"batch-1 decode without CUDA graphs: {eager_decode:.1f} tok/s")
        del llm
        _free(device)
    llm = engine()
    backend = llm.engine.runner.backend.name
    # the sizes only: a local holding the graph runner kept its pools and the KV cache from the next engine
    graph_sizes = llm.engine.runner.graphs.sizes if llm.engine.runner.graphs else None
    decode = engine_decode_rate(llm, prompt, args.decode_len)
    roofline = bandwidth / decode_bytes_per_token(model_dir, dtype, args.prompt_len + args.decode_len // 2)
    print(f"batch-1 decode: {decode:.1f} tok/s = {decode / roofline:.0%} of the {roofline:.0f} tok/s roofline "
          f"({bandwidth / 1e12:.2f} TB/s copy bandwidth); backend {backend}, "
          f"CUDA graphs {'for batch sizes ' + str(graph_sizes) if graph_sizes else 'off'}")
    throughput = {b: engine_throughput(llm, random_prompts(b, args.prompt_len, vocab, seed=b), args.output_len)
                  for b in batch_sizes}
    for b, rate in throughput.items():
        print(f"engine, {b} sequences: {rate:.0f} output tok/s")
    latency = {r: engine_latency_at_rate(llm, r, random_prompts(args.rate_requests, args.prompt_len, vocab, seed=5),
                                         args.output_len, tag=f"rate{r}") for r in rates}
    for r, lat in latency.items():
        print(f"{r:g} req/s: TTFT p50 {lat['ttft_p50'] * 1e3:.0f} ms, p90 {lat['ttft_p90'] * 1e3:.0f} ms, "
              f"ITL {lat['itl_mean'] * 1e3:.1f} ms")
    del llm
    _free(device)
    # Deferred text (async output processing) is on by default on CUDA: the same runs with it off, and with
    # async scheduling on, for the A/B.
    largest = max(batch_sizes)
    inline = {}
    for name, overrides in (("not deferred", dict(async_output_processing=False)),
                            ("async scheduling", dict(async_scheduling=True))):
        llm = engine(**overrides)
        inline[name] = {"decode": engine_decode_rate(llm, prompt, args.decode_len),
                        largest: engine_throughput(llm, random_prompts(largest, args.prompt_len, vocab, seed=largest),
                                                   args.output_len)}
        print(f"{name}: batch-1 decode {inline[name]['decode']:.1f} tok/s, {largest} sequences "
              f"{inline[name][largest]:.0f} tok/s (default: {decode:.1f}, {throughput[largest]:.0f})")
        del llm
        _free(device)
    lora = {}
    if args.lora_adapters:
        lora_batch = min(batch_sizes)
        prompts = random_prompts(lora_batch, args.prompt_len, vocab, seed=11)
        adapters = [LoRARequest(f"bench-{i}", i + 1, str(build_random_adapter(
            Path(".cache") / f"{model_dir.name}-lora-{i}", model_dir, rank=LORA_RANK, seed=i)))
            for i in range(args.lora_adapters)]
        routed = [adapters[i % len(adapters)] for i in range(lora_batch)]
        for eager in (False, True):
            llm = engine(enable_lora=True, max_loras=len(adapters), max_lora_rank=LORA_RANK, enforce_eager=eager)
            llm.generate([{"prompt_token_ids": p} for p in prompts[:len(adapters)]], greedy(4), lora_request=adapters)
            if not eager:
                lora["base"] = engine_throughput(llm, prompts, args.output_len)
            lora["eager" if eager else "mixed"] = engine_throughput(llm, prompts, args.output_len, routed)
            del llm
            _free(device)
        print(f"multi-LoRA, {lora_batch} sequences: base {lora['base']:.0f} tok/s, {len(adapters)} adapters mixed "
              f"{lora['mixed']:.0f} tok/s, mixed without CUDA graphs {lora['eager']:.0f} tok/s")

    hf_decode = hf_static = hf_cb = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        hf_generate_seconds(hf, [prompt], 4, device)  # warm-up
        first = hf_generate_seconds(hf, [prompt], 1, device)
        hf_decode = (args.decode_len - 1) / (hf_generate_seconds(hf, [prompt], args.decode_len, device) - first)
        print(f"transformers generate, batch-1 decode: {hf_decode:.1f} tok/s")
        hf_static, hf_cb = {}, {}
        for b in batch_sizes:
            prompts = random_prompts(b, args.prompt_len, vocab, seed=b)
            hf_static[b] = b * args.output_len / hf_generate_seconds(hf, prompts, args.output_len, device)
            hf_cb[b] = hf_generate_batch_rate(hf, prompts, args.output_len)
            print(f"transformers, {b} sequences: generate {hf_static[b]:.0f} tok/s, generate_batch "
                  f"{'n/a' if hf_cb[b] is None else f'{hf_cb[b]:.0f} tok/s'}")
    if not args.smoke:
        record(args, shape, backend, bandwidth, decode, eager_decode, roofline, throughput, latency, hf_decode,
               hf_static, hf_cb, lora, inline)


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def record(args, shape, backend, bandwidth, decode, eager_decode, roofline, throughput, latency, hf_decode, hf_static,
           hf_cb, lora, inline) -> None:
    gpu = torch.cuda.get_device_name()

    def ratio(mine: float, peer: float | None) -> str:
        return "n/a" if not peer else f"{mine / peer:.2f}x"

    table = ["| run | kubeinfer | transformers `generate` | speed-up | `generate_batch` | speed-up |",
             "|---|---|---|---|---|---|",
             f"| batch-1 decode (tok/s) | {decode:.1f} ({decode / roofline:.0%} of roofline {roofline:.0f}) | "
             f"{hf_decode or 0:.1f} | {ratio(decode, hf_decode)} | | |"]
    if eager_decode:
        table.append(f"| batch-1 decode, `enforce_eager` (tok/s) | {eager_decode:.1f} | {hf_decode or 0:.1f} | "
                     f"{ratio(eager_decode, hf_decode)} | | |")
    for b, rate in throughput.items():
        static, cb = (hf_static or {}).get(b), (hf_cb or {}).get(b)
        table.append(f"| {b} sequences (output tok/s) | {rate:.0f} | {static or 0:.0f} | {ratio(rate, static)} | "
                     f"{cb or 0:.0f} | {ratio(rate, cb)} |")
    largest = max(throughput)
    off, ahead = inline["not deferred"], inline["async scheduling"]
    deferral = ["| run | default (text deferred) | `--disable-async-output-proc` | default vs it | `--async-scheduling` "
                "| it vs default |", "|---|---|---|---|---|---|"]
    for key, label, mine in (("decode", "batch-1 decode (tok/s)", decode),
                             (largest, f"{largest} sequences (output tok/s)", throughput[largest])):
        deferral.append(f"| {label} | {mine:.1f} | {off[key]:.1f} | {ratio(mine, off[key])} | {ahead[key]:.1f} | "
                        f"{ratio(ahead[key], mine)} |")
    lat = ["| request rate | TTFT p50 | TTFT p90 | inter-token latency |", "|---|---|---|---|"]
    lat += [f"| {r:g} req/s | {v['ttft_p50'] * 1e3:.0f} ms | {v['ttft_p90'] * 1e3:.0f} ms | "
            f"{v['itl_mean'] * 1e3:.1f} ms |" for r, v in latency.items()]
    lora_text = []
    if lora:
        lora_text = [
            "", f"Multi-LoRA ({args.lora_adapters} random rank-{LORA_RANK} adapters on all seven projections, "
            f"{min(int(b) for b in args.batch_sizes.split(','))} sequences routed round-robin over them):", "",
            "| run | output tok/s | vs base model |", "|---|---|---|",
            f"| base model, LoRA enabled | {lora['base']:.0f} | 1.00x |",
            f"| adapters mixed in one batch | {lora['mixed']:.0f} | {ratio(lora['mixed'], lora['base'])} |",
            f"| adapters mixed, `enforce_eager` | {lora['eager']:.0f} | {ratio(lora['eager'], lora['base'])} |"]
    body = "\n".join([
        f"Command: `python benchmarks/bench_gpu.py --shape {shape} --batch-sizes {args.batch_sizes}` "
        f"(`make bench-gpu`). GPU: {gpu}, torch {torch.__version__}, bf16, attention backend `{backend}`, "
        f"CUDA graphs for decode unless `enforce_eager`, gpu_memory_utilization {args.gpu_memory_utilization}; "
        f"copy bandwidth measured in this run {bandwidth / 1e12:.2f} TB/s.",
        f"Model: random-init {shape} shape. Requests: {args.prompt_len}-token prompts, {args.output_len} output "
        f"tokens (batch-1 decode: {args.decode_len}), greedy, all submitted at once; transformers runs one static "
        "batch of the same requests.", "", *table, "",
        f"Latency under Poisson arrivals ({args.rate_requests} requests per rate, engine only):", "", *lat,
        *lora_text, "", "Host work between steps: deferred text (a step's detokenizing and outputs done while the "
        "GPU runs the next step) and async scheduling (the next step launched before this one's ids are read):",
        "", *deferral])
    update_results(f"gpu-{shape}", f"GPU: {shape} on {gpu}", body)


if __name__ == "__main__":
    main()
