"""Speculative decoding, n-gram and draft model, against no speculation: same engine, same model, same run.

The model is the demo model (trained here, `kubeinfer demo-model`, built into .cache/demo-model if missing,
about a minute) and the draft its one-layer distillation.
* batch 1: decode tokens/s on copy-heavy prompts and on prompts that do not copy. A copy-heavy prompt is
  built from the model's own output: a prefix P (a chat question) is continued greedily to G, and the
  prompt is P + G + P (the document, then its beginning again, as when editing or quoting): if the model
  continues as it did, the continuation is in the prompt. The acceptance rate says how far that held.
  The others are random tokens; a third row samples chat questions (temperature 0.8, top-p 0.95, seeded), where
  the draft model proposes from its own distribution.
* batch 8 and 32: throughput of a mixed workload (half copy-heavy) without speculation, with n-gram
  always on, and with the adaptive switch (`disable_by_batch_size` 8) for n-gram and for the draft.

    python benchmarks/bench_spec_decode.py [--tokens 96] [--prompts 3] [--k 4]
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.dev.demo.recipe import DEMO_QUESTIONS  # noqa: E402
from kubeinfer.dev.demo_model import build_demo_model  # noqa: E402
from kubeinfer.engine import LLM, SamplingParams  # noqa: E402

DEMO_DIR = Path(__file__).parents[1] / ".cache" / "demo-model"


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def sampled(max_tokens: int, seed: int) -> SamplingParams:
    """A chat-like sampled request: what the draft model's own-distribution drafts are for."""
    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def plain_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(count)]


def chat_prompts(llm: LLM, count: int) -> list[list[int]]:
    tokenizer = llm.engine.tokenizer
    questions = [f"<|im_start|>user\n{q} ({i})<|im_end|>\n<|im_start|>assistant\n"
                 for i in range(count) for q in DEMO_QUESTIONS][:count]
    return [tokenizer.encode(q) for q in questions]


def copy_prompts(llm: LLM, count: int, tokens: int) -> list[list[int]]:
    prefixes = chat_prompts(llm, count)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prefixes], greedy(tokens + 32))
    return [p + o.outputs[0].token_ids + p for p, o in zip(prefixes, outputs)]


def rotated(names: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """The systems in another order each pass: a pass runs slower right after "n-gram always" at batch 32
    (measured: whichever system came next lost 10-20%), so no system should always be the one after it."""
    shift = repeat % len(names)
    return names[shift:] + names[:shift]


def run(llm: LLM, prompts: list[list[int]], tokens: int, params: SamplingParams | None = None) -> tuple[float, int]:
    """(seconds, output tokens) of one generate call over all prompts at once (greedy unless `params`)."""
    gc.collect()  # the previous pass's garbage is not this one's cost
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params or greedy(tokens))
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def acceptance(llm: LLM, before: tuple[int, int]) -> float:
    s = llm.engine.speculator
    drafted, accepted = s.num_draft_tokens - before[0], s.num_accepted_tokens - before[1]
    return accepted / drafted if drafted else 0.0


def counters(llm: LLM) -> tuple[int, int]:
    s = llm.engine.speculator
    return (s.num_draft_tokens, s.num_accepted_tokens) if s else (0, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=96, help="output tokens per request")
    parser.add_argument("--prompts", type=int, default=3, help="prompts of each kind at batch 1")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved passes; each system's fastest counts")
    args = parser.parse_args()
    build_demo_model(DEMO_DIR, progress=False)  # reused when built
    model = str(DEMO_DIR / "base")
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    draft = {"model": str(DEMO_DIR / "draft"), "num_speculative_tokens": args.k}
    batches = [int(b) for b in args.batches.split(",")]
    adaptive_limit = 8  # where speculation stops paying for this small model on this CPU (see the always-on column)
    engines = {"off": LLM(model), "ngram": LLM(model, speculative_config=ngram),
               "draft": LLM(model, speculative_config=draft),
               "ngram, adaptive": LLM(model, speculative_config={**ngram, "disable_by_batch_size": adaptive_limit}),
               "draft, adaptive": LLM(model, speculative_config={**draft, "disable_by_batch_size": adaptive_limit})}
    vocab_size = engines["off"].engine.spec.vocab_size
    kinds = {"copy-heavy": copy_prompts(engines["off"], max(args.prompts, max(batches) // 2), args.tokens),
             "no copying": plain_prompts(max(args.prompts, max(batches)), 96, vocab_size, seed=2)}
    chat = chat_prompts(engines["off"], args.prompts)
    lengths = ", ".join(f"{k} {sum(map(len, v)) // len(v)}" for k, v in kinds.items())
    print(f"torch threads {torch.get_num_threads()}; mean prompt lengths: {lengths}")
    for llm in engines.values():  # warm up
        run(llm, kinds["no copying"][:1], 8)

    rows = ["| prompts | tokens/s, no speculation | n-gram | speed-up | acceptance | draft model | speed-up | acceptance |",
            "|---|---|---|---|---|---|---|---|"]
    batch_one = [(kind, prompts, False) for kind, prompts in kinds.items()]
    batch_one.append(("chat, sampled (temperature 0.8, top-p 0.95)", chat, True))
    for kind, prompts, is_sampled in batch_one:
        speed, accepted = {}, {}
        for repeat in range(args.repeats):  # interleaved; each system's fastest pass counts
            for name in rotated(("off", "ngram", "draft"), repeat):
                llm, seconds, produced = engines[name], 0.0, 0
                before = counters(llm)
                for i, prompt in enumerate(prompts[:args.prompts]):  # one at a time: batch 1
                    params = sampled(args.tokens, seed=1000 * repeat + i) if is_sampled else None
                    s, n = run(llm, [prompt], args.tokens, params)
                    seconds, produced = seconds + s, produced + n
                speed[name] = max(speed.get(name, 0.0), produced / seconds)
                accepted[name] = acceptance(llm, before) if name != "off" else 0.0
        rows.append(f"| {kind} | {speed['off']:.1f} | {speed['ngram']:.1f} | {speed['ngram'] / speed['off']:.2f}x "
                    f"| {accepted['ngram']:.0%} | {speed['draft']:.1f} | {speed['draft'] / speed['off']:.2f}x "
                    f"| {accepted['draft']:.0%} |")
        print(rows[-1], flush=True)

    header = ("| batch | tokens/s, no speculation | n-gram always | n-gram adaptive | vs none | draft adaptive | vs none "
              "| n-gram acceptance |")
    table = [header, "|---|---|---|---|---|---|---|---|"]
    for batch in batches:
        mixed = kinds["copy-heavy"][:batch // 2] + kinds["no copying"][:batch - batch // 2]
        speed, accepted = {}, 0.0
        for repeat in range(args.repeats):
            for name in rotated(("off", "ngram", "ngram, adaptive", "draft, adaptive"), repeat):
                llm = engines[name]
                before = counters(llm)
                seconds, produced = run(llm, mixed, args.tokens)
                speed[name] = max(speed.get(name, 0.0), produced / seconds)
                if name == "ngram":
                    accepted = acceptance(llm, before)
        table.append(f"| {batch} | {speed['off']:.1f} | {speed['ngram']:.1f} | {speed['ngram, adaptive']:.1f} | "
                     f"{speed['ngram, adaptive'] / speed['off']:.2f}x | {speed['draft, adaptive']:.1f} | "
                     f"{speed['draft, adaptive'] / speed['off']:.2f}x | {accepted:.0%} |")
        print(table[-1], flush=True)

    command = (f"python benchmarks/bench_spec_decode.py --tokens {args.tokens} --prompts {args.prompts} --k {args.k} "
               f"--batches {args.batches} --repeats {args.repeats}")
    update_results("spec-decode", "Speculative decoding (n-gram and draft model) vs none", (
        f"`{command}` on the demo model (4 layers, hidden 128; CPU, {torch.get_num_threads()} torch threads, greedy, "
        f"{args.tokens} output tokens per request, num_speculative_tokens={args.k}, fastest of {args.repeats} "
        "interleaved passes); the draft model is its one-layer, "
        "hidden-64 distillation. Copy-heavy prompts are P + G + P with P a chat question and G the model's own "
        "greedy continuation of P; \"no copying\" prompts are random tokens; \"chat, sampled\" are the questions P "
        "alone, sampled with a seed per request (the draft model draws its drafts from its own distribution and "
        "verification accepts with min(1, p/q)); all other rows are greedy. Batch 1, one request at a time:\n\n"
        + "\n".join(rows) + f"\n\nMixed batches (half copy-heavy); adaptive turns speculation off from "
        f"{adaptive_limit} requests (`disable_by_batch_size`):\n\n" + "\n".join(table) +
        "\n\nOn this CPU the forward pass of this small target costs about 0.6 ms at one token and 0.95 ms at five: "
        "its weights fit in the caches, so its products are bound by arithmetic, not memory, and five tokens cost "
        "about three times one in them (a model that streams its weights from memory pays little for the extra "
        "tokens); a draft pass costs about 0.26 ms. That bounds the gain. With speculation switched off the "
        "engine's decode steps at batch 32 cost what they cost without a speculator to within 2% by the step timer "
        "(schedule, sample and outputs +5-10 us each). The systems run in a rotated order each pass, after a "
        "gc.collect(): whichever ran right after \"n-gram always\" at batch 32 lost 10-20%. "
        "Verification runs eagerly (as a "
        "chunked-prefill query of 1 + k tokens), also on a GPU: no CUDA graph for it yet. This machine is shared "
        "and noisy; compare rows of one run."))


if __name__ == "__main__":
    main()
