"""llama.cpp as a peer for batch-1 decode (bench_decode_roofline.py --peer llama.cpp): the benchmark's
model converted by llama.cpp's own converter (convert_hf_to_gguf.py), run through llama-cpp-python with
the same number of threads and fed the same token ids, greedy, timed token by token.

What it needs, and why it is not installed by `make setup`:
  * `pip install llama-cpp-python` builds llama.cpp from source (about 10 minutes on 2 cores);
  * the converter is not in that wheel. It is in the sdist (`pip download --no-deps --no-binary :all:
    llama-cpp-python`, then vendor/llama.cpp/convert_hf_to_gguf.py with conversion/ and gguf-py/ beside
    it) or in a llama.cpp checkout: give its path with --llama-cpp-converter or LLAMA_CPP_CONVERTER.
A checkpoint without a tokenizer gets a small SentencePiece one for the conversion (the converter wants
a vocabulary; the token ids are fed directly, so what the pieces are does not matter).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HOW_TO_INSTALL = ("llama.cpp peer skipped: {missing}. To add it: `pip install llama-cpp-python` (a ~10-minute build), "
                  "and point --llama-cpp-converter (or LLAMA_CPP_CONVERTER) at convert_hf_to_gguf.py from its sdist "
                  "(`pip download --no-deps --no-binary :all: llama-cpp-python`, vendor/llama.cpp/) or a llama.cpp "
                  "checkout.")


def missing(converter: str | None) -> str | None:
    """What keeps the peer from running, or None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama_cpp is not importable"
    if not converter or not Path(converter).is_file():
        return f"no converter at {converter!r}"
    return None


def convert(model_dir: Path, outtype: str, converter: str, cache: Path) -> Path:
    """The GGUF of `model_dir` in `outtype` (f32, f16...), converted once and kept in `cache`."""
    out = cache / f"{model_dir.name}-{outtype}.gguf"
    if out.is_file():
        return out
    staging = cache / f"{model_dir.name}-gguf-source"
    staging.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        link = staging / item.name
        if not link.exists():
            link.symlink_to(item.resolve())
    if not any((staging / name).exists() for name in ("tokenizer.model", "tokenizer.json")):
        _sentencepiece_tokenizer(staging / "tokenizer")
    subprocess.run([sys.executable, converter, str(staging), "--outfile", str(out), "--outtype", outtype],
                   check=True, stdout=subprocess.DEVNULL)
    return out


def _sentencepiece_tokenizer(prefix: Path) -> None:
    import pydoc_data.topics

    import sentencepiece

    lines = [line for text in pydoc_data.topics.topics.values() for line in text.splitlines() if line.strip()]
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines[:20000]), model_prefix=str(prefix),
                                             vocab_size=256, model_type="bpe", minloglevel=2)


def decode_rate(gguf: Path, prompt: list[int], tokens: int, repeats: int, threads: int) -> float:
    """Median decode tokens/s from the first generated token to the last, after one warm-up request."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=len(prompt) + tokens + 16, n_threads=threads, n_threads_batch=threads,
                n_batch=max(32, len(prompt)), verbose=False)
    rates = []
    for attempt in range(repeats + 1):
        times = []
        for _ in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            if len(times) == (tokens if attempt else 8):
                break
        if attempt:
            rates.append((len(times) - 1) / (times[-1] - times[0]))
    return statistics.median(rates)


def version() -> str:
    import llama_cpp

    return llama_cpp.__version__


def default_converter() -> str | None:
    return os.environ.get("LLAMA_CPP_CONVERTER")
