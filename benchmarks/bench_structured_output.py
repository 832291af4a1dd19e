"""Structured output's cost: time per output token with and without a JSON-Schema constraint at batch 1
and 16 (same model, same prompts, same output lengths), and grammar compile time over the schema set,
cold (first use) and cached, plus the grammar-engine comparison that chose llguidance (xgrammar, when
installed, measured on the same schemas and tokenizer). Results go to benchmarks/RESULTS.md.

    python benchmarks/bench_structured_output.py [--tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from bench_throughput import MODEL_SHAPE  # noqa: E402
from results import update_results  # noqa: E402

from kubeinfer.engine import LLM, SamplingParams  # noqa: E402
from kubeinfer.engine.sampling_params import StructuredOutputsParams  # noqa: E402
from kubeinfer.dev.testing.json_schemas import SCHEMAS  # noqa: E402
from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402

# An array of bounded integers: every document is as long as the output length asked for (no early stop),
# so both runs decode exactly the same number of tokens.
LONG_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1000}


def per_token_ms(llm: LLM, batch: int, tokens: int, constrained: bool, repeats: int) -> float:
    spec = StructuredOutputsParams(json=LONG_SCHEMA) if constrained else None
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=True, structured_outputs=spec)
              for i in range(batch)]
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(batch)]
    llm.generate(prompts, params)  # warm-up, the same for both
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        best = min(best, time.perf_counter() - start)
        assert all(len(o.outputs[0].token_ids) == tokens for o in outputs)
    return best / tokens * 1000


def compile_times(llm: LLM) -> tuple[list[float], list[float]]:
    cold, cached = [], []
    for schema in SCHEMAS.values():
        for runs in (cold, cached):
            spec = StructuredOutputsParams(json=schema)
            start = time.perf_counter()
            llm.engine._grammar_for(SamplingParams(structured_outputs=spec))
            runs.append(time.perf_counter() - start)
    return cold, cached


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def xgrammar_row(tokenizer) -> str:
    try:
        import xgrammar as xgr
    except ImportError:
        return "| xgrammar | not installed | | |"
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)),
                                   cache_enabled=False)
    times, ok = [], 0
    for schema in SCHEMAS.values():
        start = time.perf_counter()
        try:
            compiler.compile_json_schema(json.dumps(schema))
            ok += 1
        except Exception:  # noqa: BLE001 - coverage is what is measured
            pass
        times.append(time.perf_counter() - start)
    return f"| xgrammar | {pct(times, .5) * 1e3:.2f} / {pct(times, .99) * 1e3:.2f} ms | {ok}/{len(SCHEMAS)} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir = build_random_model(tempfile.mkdtemp(), "llama", **MODEL_SHAPE)
    llm = LLM(str(model_dir), enable_prefix_caching=False)
    rows = []
    for batch in (1, 16):
        free = per_token_ms(llm, batch, args.tokens, False, args.repeats)
        constrained = per_token_ms(llm, batch, args.tokens, True, args.repeats)
        rows.append(f"| {batch} | {free:.2f} | {constrained:.2f} | {100 * (constrained / free - 1):+.1f}% |")
        print(rows[-1])
    cold, cached = compile_times(llm)
    tokenizer = llm.get_tokenizer()
    body = (f"A random Llama ({MODEL_SHAPE['num_layers']} layers, hidden {MODEL_SHAPE['hidden_size']}, vocabulary "
            f"{MODEL_SHAPE['vocab_size']}), float32 on this CPU, {args.tokens} output tokens per sequence, best of "
            f"{args.repeats} after one warm-up pass; the constraint is a JSON array of digits, so constrained and "
            "free sequences decode the same number of tokens.\n\n"
            "| batch | free ms/token | constrained ms/token | overhead |\n|---|---|---|---|\n" + "\n".join(rows) +
            f"\n\nGrammar compile over the {len(SCHEMAS)}-schema set (kubeinfer/dev/testing/json_schemas.py): cold "
            f"p50 {pct(cold, .5) * 1e3:.2f} ms, p99 {pct(cold, .99) * 1e3:.2f} ms; cached p50 "
            f"{pct(cached, .5) * 1e3:.3f} ms (a fresh matcher from the cached grammar).\n\n"
            "| engine | compile p50 / p99 | schemas compiled |\n|---|---|---|\n"
            f"| llguidance | {pct(cold, .5) * 1e3:.2f} / {pct(cold, .99) * 1e3:.2f} ms | {len(SCHEMAS)}/{len(SCHEMAS)} |\n"
            f"{xgrammar_row(tokenizer)}\n\nCommand: `python benchmarks/bench_structured_output.py`.")
    update_results("structured-output", "Structured output: per-token overhead and grammar compile time (CPU)", body)


if __name__ == "__main__":
    main()
