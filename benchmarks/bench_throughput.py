"""Offline throughput: kubeinfer's engine vs transformers on the same model and the same mixed workload.

Peers, measured in this run on this machine:
  * transformers `generate`, batched with left padding (every batch runs to its longest output);
  * transformers' own continuous batching, where this transformers has it: the manager behind
    `generate_batch`, driven as `generate_batch` drives it but with each request's own `max_new_tokens`
    (`generate_batch` itself takes one `max_new_tokens` for all requests).
The same rules for every system: one untimed pass over the whole workload first (the warm-up), then the
timed passes; with --repeats N the timed passes go round the systems N times in rotating order and each
system's figure is its fastest pass (the median is shown too). Throughput counts only the tokens each
request asked for; the table also shows how many tokens each system generated. Results go to benchmarks/RESULTS.md.

    python benchmarks/bench_throughput.py [--requests 48] [--hf-batch 16] [--repeats 3] [--dtype float32]
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from results import update_results  # noqa: E402

from kubeinfer.engine import LLM, SamplingParams  # noqa: E402
from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402

MODEL_SHAPE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536,
                   vocab_size=8192, max_position_embeddings=1024)
MAX_BATCH_TOKENS = 2048  # the engine's default token budget per step; transformers' continuous batching gets the same


def workload(count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Prompt lengths 16-256 and output lengths 16-128: both vary several-fold, as real traffic does."""
    rng = random.Random(seed)
    return [([rng.randrange(10, 8000) for _ in range(rng.randint(16, 256))], rng.randint(16, 128)) for _ in range(count)]


class EngineRunner:
    name, how = "kubeinfer engine", "continuous batching, chunked prefill, paged KV; per-request max_tokens"

    def __init__(self, model_dir: str, work, max_num_seqs: int, dtype: str) -> None:
        # No prefix caching: a timed pass must not reuse the blocks of the pass before it.
        self.llm = LLM(model_dir, max_num_seqs=max_num_seqs, enable_prefix_caching=False, dtype=dtype)
        self.work = work
        self.prompts = [{"prompt_token_ids": p} for p, _ in work]
        self.params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]

    def run(self) -> tuple[float, int]:
        start = time.perf_counter()
        outputs = self.llm.generate(self.prompts, self.params)
        elapsed = time.perf_counter() - start
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == [n for _, n in self.work], "engine output lengths differ from the requested ones"
        return elapsed, sum(lengths)

    def close(self) -> None:
        del self.llm


class HFGenerateRunner:
    name = "transformers `generate`"

    def __init__(self, model, work, batch_size: int) -> None:
        self.model, self.work, self.batch_size = model, work, batch_size
        self.how = f"static batches of {batch_size}, left-padded; each batch runs to its longest output"

    def run(self) -> tuple[float, int]:
        generated = 0
        start = time.perf_counter()
        for i in range(0, len(self.work), self.batch_size):
            chunk = self.work[i:i + self.batch_size]
            width = max(len(p) for p, _ in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, (p, _) in enumerate(chunk):  # left padding, as decoder-only generation needs
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in chunk),
                                          do_sample=False, eos_token_id=[], pad_token_id=0)
            generated += (out.shape[1] - width) * len(chunk)
        return time.perf_counter() - start, generated

    def close(self) -> None:
        pass


class HFContinuousRunner:
    """transformers' continuous batching: the loop of `generate_batch` (its context manager, add requests,
    collect the results) with each request's own max_new_tokens, which `add_request` takes and
    `generate_batch` does not. The manager persists between passes, as the engine's LLM object does, so
    that a timed pass pays for neither building it nor allocating its KV cache."""

    name = "transformers continuous batching"

    def __init__(self, model, work, max_num_seqs: int) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        self.model, self.work = model, work
        max_new = max(n for _, n in work)
        max_prompt = max(len(p) for p, _ in work)
        blocks = max_num_seqs * (max_prompt + max_new) // 16 + 64
        self.generation_config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1,
                                                  pad_token_id=0)
        # No block sharing (its prefix caching), like the engine; the same caps on sequences and tokens per step.
        self.cb_config = ContinuousBatchingConfig(page_size=16, num_blocks=blocks, max_batch_tokens=MAX_BATCH_TOKENS,
                                                  max_requests_per_batch=max_num_seqs, allow_block_sharing=False)
        self.hints = WorkloadHints(max_prompt_length=max_prompt, max_generated_length=max_new, num_requests=len(work))
        self.how = (f"`generate_batch`'s manager, paged KV, max {max_num_seqs} sequences and {MAX_BATCH_TOKENS} "
                    "tokens a step; per-request max_new_tokens")

    def run(self) -> tuple[float, int]:
        results = {}
        start = time.perf_counter()
        with self.model.continuous_batching_context_manager(
                generation_config=self.generation_config, continuous_batching_config=self.cb_config, block=True,
                timeout=5, persistent_manager=True, workload_hints=self.hints) as manager:
            ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in self.work]
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' generation thread stopped early")
        elapsed = time.perf_counter() - start
        lengths = [len(results[i].generated_tokens) for i in ids]
        assert all(results[i].error is None for i in ids), "transformers continuous batching reported errors"
        assert lengths == [n for _, n in self.work], "continuous batching output lengths differ from the requested"
        return elapsed, sum(lengths)

    def close(self) -> None:
        self.model.destroy_cached_continuous_batching_manager()


def _pct(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.0%}"


def has_continuous_batching() -> bool:
    try:
        from transformers import ContinuousBatchingConfig  # noqa: F401
        from transformers.generation.continuous_batching.utils import WorkloadHints  # noqa: F401
    except ImportError:
        return False
    return True


class OtherLoad:
    """The share of the machine's CPU that other processes used since start() (from /proc/stat: Linux only;
    None elsewhere). This machine is shared: the figure says how much a timed pass had to compete for."""

    def __init__(self) -> None:
        self.start()

    @staticmethod
    def _busy_seconds() -> float | None:
        try:
            with open("/proc/stat") as f:
                ticks = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait

    def start(self) -> None:
        self.wall, self.busy, self.own = time.perf_counter(), self._busy_seconds(), time.process_time()

    def share(self) -> float | None:
        busy = self._busy_seconds()
        if busy is None or self.busy is None:
            return None
        others = (busy - self.busy) - (time.process_time() - self.own)
        return max(0.0, others) / ((time.perf_counter() - self.wall) * (os.cpu_count() or 1))


def wait_quiet(limit_s: float, threshold: float = 0.1, window_s: float = 2.0) -> None:
    """Wait up to limit_s until other processes use under `threshold` of the CPU over a window."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        load = OtherLoad()
        time.sleep(window_s)
        share = load.share()
        if share is None or share < threshold:
            return


def run_rounds(runners: list, repeats: int, useful: int, wait_quiet_s: float = 0
               ) -> tuple[dict[str, list[float]], dict[str, list[float | None]], dict[str, int]]:
    """The rules every system gets: one untimed pass over the whole workload (the warm-up), then `repeats`
    timed passes going round the systems in rotating order; the runners are closed after. Returns each
    system's pass times, the share of the CPU others used during each pass, and the tokens it generated."""
    for r in runners:
        print(f"warm-up   {r.name:34s} {r.run()[0]:7.2f} s")
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    others: dict[str, list[float | None]] = {r.name: [] for r in runners}
    generated: dict[str, int] = {}
    for rnd in range(repeats):
        k = rnd % len(runners)
        for r in runners[k:] + runners[:k]:
            if wait_quiet_s:
                wait_quiet(wait_quiet_s)
            load = OtherLoad()
            elapsed, generated[r.name] = r.run()
            times[r.name].append(elapsed)
            others[r.name].append(load.share())
            print(f"round {rnd + 1}   {r.name:34s} {elapsed:7.2f} s  {useful / elapsed:8.1f} tok/s   "
                  f"others' CPU {_pct(others[r.name][-1])}")
    for r in runners:
        r.close()
    return times, others, generated


def results_table(runners: list, times: dict[str, list[float]], generated: dict[str, int], useful: int) -> list[str]:
    """The markdown table, the first runner being the engine the speed-ups are relative to. Other work on a
    shared machine only ever adds time, so each system's figure is its fastest timed pass (as timeit reports);
    the median is shown beside it when there are several."""
    best = {name: min(ts) for name, ts in times.items()}
    engine_s = best[runners[0].name]
    several = len(times[runners[0].name]) > 1
    head = "| system | time (s) | " + ("median (s) | " if several else "")
    table = [head + "output tok/s | engine speed-up | tokens generated | how |",
             "|---|---|" + ("---|" if several else "") + "---|---|---|---|"]
    for r in runners:
        s = best[r.name]
        extra = generated[r.name] - useful
        gen = f"{generated[r.name]} (+{extra / useful:.0%})" if extra else f"{generated[r.name]}"
        table.append(f"| {r.name} | {s:.2f} | " + (f"{statistics.median(times[r.name]):.2f} | " if several else "")
                     + f"{useful / s:.1f} | {s / engine_s:.2f}x | {gen} | {r.how} |")
    return table


def passes_line(times: dict[str, list[float]], others: dict[str, list[float | None]]) -> str:
    """Each timed pass in seconds, with the share of the CPU others used during it, for the results."""
    return "; ".join(f"{name}: " + ", ".join(f"{t:.2f} ({_pct(o)})" for t, o in zip(times[name], others[name]))
                     for name in times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed passes per system after the warm-up, in rotating order; each figure is the fastest")
    parser.add_argument("--skip-generate-batch", action="store_true",
                        help="leave out transformers' continuous batching")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="for the engine and transformers alike (bf16 pays on CPUs with AVX512-BF16 or AMX)")
    parser.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                        help="before each timed pass wait up to this long for other processes to leave the CPU "
                             "(under 10%% of it for 2 s); each pass's share of CPU used by others is reported")
    parser.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/RESULTS.md alone")
    args = parser.parse_args()
    torch.manual_seed(0)

    model_dir = Path(".cache/bench-llama-33m")
    if not (model_dir / "config.json").exists():
        build_random_model(model_dir, "llama", tokenizer=False, initializer_range=0.02, **MODEL_SHAPE)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    params = sum(p.numel() for p in hf.parameters())
    work = workload(args.requests)
    useful = sum(n for _, n in work)
    print(f"model: {params / 1e6:.1f}M params, {args.requests} requests, {useful} output tokens, "
          f"{sum(len(p) for p, _ in work)} prompt tokens; torch threads {torch.get_num_threads()}")

    runners = [EngineRunner(str(model_dir), work, args.max_num_seqs, args.dtype),
               HFGenerateRunner(hf, work, args.hf_batch)]
    if not args.skip_generate_batch and has_continuous_batching():
        runners.append(HFContinuousRunner(hf, work, args.max_num_seqs))

    times, others, generated = run_rounds(runners, args.repeats, useful, args.wait_quiet)
    table = results_table(runners, times, generated, useful)
    print("\n".join(table))
    if args.no_write:
        return
    timed = ("one timed pass each" if args.repeats == 1 else
             f"{args.repeats} timed passes each, in rotating order; time, tok/s and speed-up are from each "
             "system's fastest pass (other work on this shared machine only adds time)")
    command = (f"python benchmarks/bench_throughput.py --requests {args.requests} --hf-batch {args.hf_batch} "
               f"--repeats {args.repeats} --dtype {args.dtype}")
    if args.wait_quiet:
        command += f" --wait-quiet {args.wait_quiet:g}"
    defaults = (parser.get_default("repeats"), parser.get_default("wait_quiet"))
    make = ("`make bench`" if (args.repeats, args.wait_quiet) == defaults else
            f"`make bench` runs it with {defaults[0]} timed passes and no `--wait-quiet`")
    body = "\n".join([
        f"Command: `{command}` ({make}). Machine: "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"transformers {__import__('transformers').__version__}, {args.dtype} for all.",
        f"Model: random-init Llama, {params / 1e6:.1f}M parameters ({MODEL_SHAPE['num_layers']} layers, hidden "
        f"{MODEL_SHAPE['hidden_size']}, GQA {MODEL_SHAPE['num_heads']}/{MODEL_SHAPE['num_kv_heads']} heads). "
        f"Workload: {args.requests} requests, prompts 16-256 tokens, outputs 16-128 tokens "
        f"({useful} output tokens in all), greedy, all submitted at once.",
        f"Same rules for every system: one untimed warm-up pass over the whole workload, then {timed}. "
        "Throughput counts only the tokens the requests asked for; \"tokens generated\" is what each system "
        "actually decoded (`generate` runs every row of a batch to the batch's longest output). "
        "transformers' continuous batching is the manager `generate_batch` uses, given each request's own "
        "max_new_tokens through `add_request` (`generate_batch` takes one for all requests).",
        "", *table])
    body += ("\n\nEach timed pass in seconds, with the share of the CPU other processes on this shared machine "
             "used during it: " + passes_line(times, others) + ".")
    if args.dtype == "float32":
        update_results("offline-throughput", "Offline throughput vs transformers (CPU)", body)
    else:
        update_results(f"offline-throughput-{args.dtype}", f"Offline throughput vs transformers (CPU, {args.dtype})",
                       body)


if __name__ == "__main__":
    main()
