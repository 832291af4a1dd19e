"""llama.cpp as a peer for decode (bench_decode_roofline.py --peer llama.cpp, bench_quantized_decode.py
--peer llama.cpp): the benchmark's model converted by llama.cpp's own converter (convert_hf_to_gguf.py), run
through llama-cpp-python with the same number of threads and fed the same token ids, greedy.

How llama.cpp is run, exactly:
  * f32 / f16: `convert_hf_to_gguf.py MODEL --outtype f32|f16`.
  * Q8_0 / Q4_0 (`quantize`): the f32 GGUF through llama.cpp's own quantizer, `llama_model_quantize` with
    `llama_model_quantize_default_params()`, ftype LLAMA_FTYPE_MOSTLY_Q8_0 / MOSTLY_Q4_0, and
    `output_tensor_type` set to F32: the engine's W8A16/W4A16 checkpoints keep lm_head in float (the
    compressed-tensors `ignore: [lm_head]` that llm-compressor writes), so both sides quantize the same
    matrices (every decoder projection, blocks of 32 with an f16 scale in llama.cpp). With
    `default_output=True` the quantizer's own default type for the output matrix is kept instead; with
    `output="Q8_0"` the output matrix is Q8_0 (bench_quantized_decode.py --lm-head int8, whose checkpoints
    quantize lm_head int8 per channel).
  * batch 1 (`decode_rate`): the high-level `Llama.generate` (top_k=1), timed token by token.
  * batch B (`BatchedDecoder`, B = 1 or 16): the low-level API. One context with n_seq_max=B, n_ctx =
    B x (prompt + tokens + 16), n_batch = n_ubatch = max(512, B x prompt), n_threads = n_threads_batch =
    the engine's thread count (2 here), everything else at `llama_context_default_params()`. The B prompts
    are decoded as one llama_batch (seq ids 0..B-1), then every step is one llama_batch holding one token for
    each of the B sequences (seq id i, logits on), the next tokens being the argmax of each row of
    `llama_get_logits`. Rate: B x (tokens - 1) / the time of the tokens - 1 steps after the prefill; the
    memory (KV) is cleared between rounds. llama.cpp's log is silenced (llama_log_set).

What it needs, and why it is not installed by `make setup`:
  * `pip install llama-cpp-python` builds llama.cpp from source (about 10 minutes on 2 cores);
  * the converter is not in that wheel. It is in the sdist (`pip download --no-deps --no-binary :all:
    llama-cpp-python`, then vendor/llama.cpp/convert_hf_to_gguf.py with conversion/ and gguf-py/ beside
    it) or in a llama.cpp checkout: give its path with --llama-cpp-converter or LLAMA_CPP_CONVERTER.
A checkpoint without a tokenizer gets a small SentencePiece one for the conversion (the converter wants
a vocabulary; the token ids are fed directly, so what the pieces are does not matter).
"""
from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

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


def quantize(f32_gguf: Path, kind: str, default_output: bool = False, output: str = "F32") -> Path:
    """`f32_gguf` through llama.cpp's quantizer to Q8_0 or Q4_0 (module docstring), kept beside it. `output`: the
    output matrix's type, F32 or Q8_0 (for checkpoints whose lm_head is int8 per channel)."""
    import llama_cpp

    suffix = "-default-output" if default_output else "" if output == "F32" else f"-output-{output.lower()}"
    out = f32_gguf.with_name(f32_gguf.name.replace("-f32.gguf", f"-{kind.lower()}{suffix}.gguf"))
    if out.is_file():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}[kind]
    if not default_output:
        params.output_tensor_type = {"F32": llama_cpp.GGML_TYPE_F32, "Q8_0": llama_cpp.GGML_TYPE_Q8_0}[output]
    params.nthread = os.cpu_count() or 1
    tmp = out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(f32_gguf).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {f32_gguf} ({kind})")
    tmp.rename(out)
    return out


class BatchedDecoder:
    """llama.cpp's low-level API on one GGUF: a context per batch size B (n_seq_max=B; module docstring)."""

    def __init__(self, gguf: Path, threads: int, prompt_len: int, tokens: int) -> None:
        import llama_cpp

        llama_cpp.llama_backend_init()
        llama_cpp.llama_log_set(_SILENT, None)
        self.threads, self.prompt_len, self.tokens = threads, prompt_len, tokens
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.contexts: dict[int, tuple] = {}

    def _context(self, n: int):
        import llama_cpp

        if n not in self.contexts:
            params = llama_cpp.llama_context_default_params()
            params.n_seq_max, params.n_ctx = n, n * (self.prompt_len + self.tokens + 16)
            params.n_batch = params.n_ubatch = max(512, n * self.prompt_len)
            params.n_threads = params.n_threads_batch = self.threads
            self.contexts[n] = (llama_cpp.llama_init_from_model(self.model, params),
                                llama_cpp.llama_batch_init(params.n_batch, 0, n))
        return self.contexts[n]

    def rate(self, prompts: list[list[int]]) -> float:
        """Aggregate decode tokens/s of one round: the prompts prefilled together, then tokens - 1 steps."""
        import llama_cpp

        ctx, batch = self._context(len(prompts))
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)

        def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
            """entries: (token, position, sequence, wants logits); the argmax of each logits row asked for."""
            for i, (token, pos, seq, logits) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
                batch.seq_id[i][0] = seq
            batch.n_tokens = len(entries)
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            rows = sum(e[3] for e in entries)
            pointer = ctypes.cast(llama_cpp.llama_get_logits(ctx), ctypes.POINTER(ctypes.c_float))
            return np.ctypeslib.as_array(pointer, shape=(rows, self.vocab)).argmax(-1).tolist()

        next_tokens = decode([(t, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts)
                              for pos, t in enumerate(p)])
        positions = [len(p) for p in prompts]
        start = time.perf_counter()
        for _ in range(self.tokens - 1):
            next_tokens = decode([(t, pos, seq, True) for seq, (t, pos) in enumerate(zip(next_tokens, positions))])
            positions = [pos + 1 for pos in positions]
        return len(prompts) * (self.tokens - 1) / (time.perf_counter() - start)

    def close(self) -> None:
        import llama_cpp

        for ctx, batch in self.contexts.values():
            llama_cpp.llama_batch_free(batch)
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(self.model)


def _silence(level, text, user_data) -> None:
    pass


try:
    import llama_cpp as _llama_cpp

    _SILENT = _llama_cpp.llama_log_callback(_silence)  # kept referenced: llama.cpp calls it from C
except ImportError:
    _SILENT = None


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
