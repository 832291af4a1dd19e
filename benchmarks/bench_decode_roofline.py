"""Decode speed at batch 1 against the memory-bandwidth roofline of this machine, and against transformers.

At batch 1 every decode step reads all the weights (and the KV cache so far) once and does little
arithmetic with them, so tokens/s cannot beat  memory bandwidth / bytes read per token.  The bandwidth
is measured here, in this run, with the same torch threads the engine uses:
  * read:  `x.sum()` over a buffer far larger than the caches (the bound decode is held to);
  * copy:  `y.copy_(x)`, counting the bytes read and written (STREAM's convention);
  * gemv:  `F.linear` of one token through a large weight matrix, i.e. what a decode step does.
The roofline uses the read figure. Peers: transformers `generate` at batch 1 on the same model, timed
token by token through a streamer; and the step's matrix products alone (every weight matrix of the model
through a one-token `F.linear`, nothing else), which shows how much of a step the kernels themselves take;
with `--peer llama.cpp`, llama.cpp in f32 and f16 on the same model and token ids (llama_cpp_peer.py says
what it needs; without it the row is skipped with instructions). Results go to benchmarks/RESULTS.md.
int8/int4 weights against llama.cpp Q8_0/Q4_0, at batch 1 and 16: bench_quantized_decode.py --peer llama.cpp.

    python benchmarks/bench_decode_roofline.py [--tokens 256] [--repeats 3] [--peer llama.cpp]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
import llama_cpp_peer  # noqa: E402
from bench_throughput import MODEL_SHAPE  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.engine import LLM, SamplingParams  # noqa: E402
from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402

PROMPT_LEN = 32


def best_seconds(fn, repeats: int) -> float:
    fn()  # first touch: page faults and caches, not bandwidth
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_bandwidth(buffer_mib: int, repeats: int) -> dict[str, float]:
    """Bytes per second for a streaming read, a copy and a one-token matrix-vector product."""
    nbytes = buffer_mib << 20
    x = torch.rand(nbytes // 4)
    y = torch.empty_like(x)
    weight = x.view(-1, 4096)  # the same bytes, seen as a [rows, 4096] fp32 weight matrix
    token = torch.rand(1, 4096)
    with torch.inference_mode():
        read = nbytes / best_seconds(x.sum, repeats)
        copy = 2 * nbytes / best_seconds(lambda: y.copy_(x), repeats)
        gemv = nbytes / best_seconds(lambda: F.linear(token, weight), repeats)
    return {"read": read, "copy": copy, "gemv": gemv}


def bytes_per_token(model, context: float) -> float:
    """Weights read by one decode step (the embedding table only for one row) plus the KV cache read at
    `context` tokens of history."""
    config = model.config
    element = next(model.parameters()).element_size()
    embedding = model.get_input_embeddings().weight
    weights = sum(p.numel() for p in model.parameters()) - embedding.numel() + embedding.shape[1]
    head_dim = config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return element * (weights + kv_per_token * context)


def matmuls_only_rate(model, repeats: int) -> float:
    """Tokens/s if a decode step were nothing but its one-token products with the model's own weight
    matrices (every Linear, lm_head included), run back to back through `F.linear`: the part of a step
    that streams the weights, at the speed torch's kernels manage on these shapes."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.rand(1, w.shape[1]) for w in weights]

    def step() -> None:
        for x, w in zip(inputs, weights):
            F.linear(x, w)
    with torch.inference_mode():
        return 1 / best_seconds(step, repeats)


def engine_decode_rate(model_dir: str, prompt: list[int], tokens: int, repeats: int) -> float:
    """Median decode tokens/s of one request at a time, from its first token to its last."""
    llm = LLM(model_dir, max_num_seqs=1, enable_prefix_caching=False, num_kv_blocks=64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.add_request("warm-up", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    rates = []
    with tqdm(total=tokens * repeats, desc="kubeinfer engine, batch 1", unit="tok", mininterval=0.5) as bar:
        for r in range(repeats):
            engine.add_request(f"r{r}", list(prompt), params)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    bar.update(1)
                    if output.finished:
                        m = output.metrics
                        rates.append((tokens - 1) / (m["last_token_time"] - m["first_token_time"]))
    return statistics.median(rates)


class _TokenClock:
    """A transformers streamer that timestamps every generated token (its first put() is the prompt)."""

    def __init__(self, bar: tqdm) -> None:
        self.bar, self.times, self._prompt_seen = bar, [], False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.bar.update(1)

    def end(self) -> None:
        pass


def hf_decode_rate(model, prompt: list[int], tokens: int, repeats: int) -> float:
    ids = torch.tensor([prompt])
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=[], pad_token_id=0)
    rates = []
    bar = tqdm(total=tokens * repeats, desc="transformers generate, batch 1", unit="tok", mininterval=0.5)
    with torch.inference_mode(), bar:
        model.generate(ids, max_new_tokens=8, **kwargs)  # warm-up
        for _ in range(repeats):
            clock = _TokenClock(bar)
            model.generate(ids, max_new_tokens=tokens, streamer=clock, **kwargs)
            rates.append((len(clock.times) - 1) / (clock.times[-1] - clock.times[0]))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=3, help="requests per system (the median is reported)")
    parser.add_argument("--buffer-mib", type=int, default=512, help="bandwidth test buffer, far above cache size")
    parser.add_argument("--peer", choices=("llama.cpp",), action="append", default=[],
                        help="also measure llama.cpp (needs llama-cpp-python and its converter)")
    parser.add_argument("--llama-cpp-converter", default=llama_cpp_peer.default_converter(),
                        help="llama.cpp's convert_hf_to_gguf.py (default: $LLAMA_CPP_CONVERTER)")
    args = parser.parse_args()
    torch.manual_seed(0)

    model_dir = Path(".cache/bench-llama-33m")  # the model of bench_throughput.py, built the same way
    if not (model_dir / "config.json").exists():
        build_random_model(model_dir, "llama", tokenizer=False, initializer_range=0.02, **MODEL_SHAPE)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = torch.randint(10, MODEL_SHAPE["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()

    bandwidth = measure_bandwidth(args.buffer_mib, repeats=5)
    per_token = bytes_per_token(hf, context=PROMPT_LEN + args.tokens / 2)
    roofline = bandwidth["read"] / per_token
    print(f"bandwidth: read {bandwidth['read'] / 1e9:.1f} GB/s, copy {bandwidth['copy'] / 1e9:.1f} GB/s, "
          f"gemv {bandwidth['gemv'] / 1e9:.1f} GB/s; {per_token / 1e6:.1f} MB per token -> roofline "
          f"{roofline:.1f} tok/s")
    engine = engine_decode_rate(str(model_dir), prompt, args.tokens, args.repeats)
    print(f"kubeinfer engine        {engine:7.1f} tok/s  ({engine / roofline:.0%} of the roofline)")
    hf_rate = hf_decode_rate(hf, prompt, args.tokens, args.repeats)
    print(f"transformers generate   {hf_rate:7.1f} tok/s  ({hf_rate / roofline:.0%} of the roofline)")

    kernel_bound = matmuls_only_rate(hf, repeats=20)
    peers = []
    if "llama.cpp" in args.peer:
        why_not = llama_cpp_peer.missing(args.llama_cpp_converter)
        if why_not:
            print(llama_cpp_peer.HOW_TO_INSTALL.format(missing=why_not))
        for outtype in () if why_not else ("f32", "f16"):
            gguf = llama_cpp_peer.convert(model_dir, outtype, args.llama_cpp_converter, Path(".cache"))
            rate = llama_cpp_peer.decode_rate(gguf, prompt, args.tokens, args.repeats, torch.get_num_threads())
            print(f"llama.cpp {outtype}           {rate:7.1f} tok/s  ({rate / roofline:.0%} of the roofline)")
            peers.append((f"llama.cpp {outtype}", rate, f"llama-cpp-python {llama_cpp_peer.version()} (built here), "
                                                        f"converted by its convert_hf_to_gguf.py --outtype {outtype}"))
    params = sum(p.numel() for p in hf.parameters())
    rows = [("memory-bandwidth roofline", roofline, f"read bandwidth / {per_token / 1e6:.1f} MB per token"),
            ("the step's matrix products alone", kernel_bound, "every weight matrix through one-token `F.linear`, "
                                                                "nothing else"),
            ("kubeinfer engine", engine, "LLMEngine, max_num_seqs=1, paged KV"),
            ("transformers `generate`", hf_rate, "dynamic cache, greedy"), *peers]
    table = ["| system | decode tok/s | ms / token | share of roofline | how |", "|---|---|---|---|---|"]
    table += [f"| {name} | {rate:.1f} | {1000 / rate:.2f} | {rate / roofline:.0%} | {how} |"
              for name, rate, how in rows]
    body = "\n".join([
        f"Command: `python benchmarks/bench_decode_roofline.py --tokens {args.tokens} --repeats {args.repeats}"
        + "".join(f" --peer {peer}" for peer in args.peer) + "`. "
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, float32.",
        f"Model: the random-init Llama of the throughput benchmark ({params / 1e6:.1f}M parameters). "
        f"One request at a time: a {PROMPT_LEN}-token prompt, {args.tokens} tokens greedy; decode rate "
        f"from the first token to the last, median of {args.repeats}.",
        f"Bandwidth measured in the same run ({args.buffer_mib} MiB buffers, best of 5): read (`sum`) "
        f"{bandwidth['read'] / 1e9:.1f} GB/s, copy {bandwidth['copy'] / 1e9:.1f} GB/s, one-token `F.linear` "
        f"through one {args.buffer_mib} MiB matrix {bandwidth['gemv'] / 1e9:.1f} GB/s. Bytes per token: every "
        f"weight once (one embedding row) plus the KV cache at the mean context, {per_token / 1e6:.1f} MB.",
        "", *table, "",
        f"The engine decodes at {engine / roofline:.0%} of what the memory system allows, "
        f"{engine / hf_rate:.2f}x transformers `generate`"
        + "".join(f", {engine / rate:.2f}x {name}" for name, rate, _ in peers) + f". Of its {1000 / engine:.1f} ms per token, "
        f"{1000 / kernel_bound:.1f} ms are the matrix products themselves (timed alone through `F.linear`, with "
        f"the checkpoint's unfused shapes), which at the measured read bandwidth would need {1000 / roofline:.1f} ms."])
    update_results("decode-roofline", "Batch-1 decode vs the memory-bandwidth roofline (CPU)", body)


if __name__ == "__main__":
    main()
