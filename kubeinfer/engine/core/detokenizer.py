"""Loading the tokenizer, incremental detokenization and stop-string handling.

Decoding one token at a time is wrong for byte-level and SentencePiece tokenizers: a character may
span tokens, and a token's leading space depends on what precedes it. With a fast (Rust) tokenizer,
each step goes through `tokenizers`' own `DecodeStream`, primed with the prompt's last tokens: it
holds bytes back until they form whole characters and is about 9x cheaper per token than decoding
twice in Python (0.7 vs 6.2 us here). It gives the same text as the full decode except at the very
end: it has no flush, so bytes of a final incomplete character would be lost where `decode` (and
OpenAI's API) shows U+FFFD. `flush` therefore, and every step with a slow tokenizer, decodes a short
window (a few tokens of context plus the unread ones) with and without the new tokens and emits the
difference, holding text back while it ends in an incomplete UTF-8 sequence.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from tokenizers.decoders import DecodeStream

from ..sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CONTEXT_TOKENS = 5  # tokens before the unread ones that give the window its leading-space context
REPLACEMENT_CHAR = "\ufffd"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the context window
        self.read_offset = len(self.tokens)  # tokens before this have been emitted
        self.text = ""
        self._fast = getattr(tokenizer, "_tokenizer", None)  # the Rust tokenizer behind a fast HF tokenizer
        self._stream = (DecodeStream(ids=self.tokens, skip_special_tokens=skip_special_tokens)
                        if self._fast is not None else None)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> str:
        """Append a token; return the newly completed text (possibly empty)."""
        self.tokens.append(token_id)
        if self._stream is not None:
            delta = self._stream.step(self._fast, token_id) or ""
        else:
            delta = self._window_delta()
        if delta:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            self.text += delta
        return delta

    def _window_delta(self) -> str:
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing visible yet, or a character still incomplete
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end of a sequence: emit whatever is held back, even an incomplete character,
        so the text equals the full decode."""
        full_text = self._decode(self.tokens[self.prefix_offset:])
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        delta = full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.text += delta
        return delta


class StopStringMatcher:
    """Finds the earliest stop string in the generated text, looking only at text that could hold a
    new match, and says how much text is safe to stream (a partial stop string is held back)."""

    def __init__(self, params: SamplingParams) -> None:
        self.stops = params.stop or []
        self.include = params.include_stop_str_in_output
        self.max_len = max((len(s) for s in self.stops), default=0)
        # Built once per request: the stops by first character, so that most positions of the text are
        # ruled out by one lookup at each token instead of a comparison with every stop.
        self.by_first: dict[str, list[str]] = {}
        for stop in self.stops:
            self.by_first.setdefault(stop[0], []).append(stop)

    def find(self, text: str, num_new_chars: int) -> tuple[str, int] | None:
        """(stop string, index where the output text ends) if a stop string completed in the new text."""
        if not self.stops or num_new_chars == 0:
            return None
        search_from = max(0, len(text) - num_new_chars - self.max_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            pos = text.find(stop, search_from)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return None
        pos, stop = best
        return stop, pos + len(stop) if self.include else pos

    def safe_length(self, text: str) -> int:
        """Length of the prefix of text that can be streamed without revealing a partial stop string."""
        if not self.stops or self.include:
            return len(text)
        for start in range(max(0, len(text) - self.max_len + 1), len(text)):  # the longest held tail first
            candidates = self.by_first.get(text[start])
            if candidates:
                tail = text[start:]
                if any(s.startswith(tail) for s in candidates):
                    return start
        return len(text)


def load_tokenizer(path: str):
    """The Hugging Face tokenizer at path, or None (only token-id prompts then) when there is none."""
    from transformers import AutoTokenizer

    if Path(path).is_dir() and not any((Path(path) / name).exists() for name in TOKENIZER_FILES):
        logger.info("no tokenizer files in %s; only token-id prompts will work", path)
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        logger.warning("no tokenizer loaded from %s (%s); only token-id prompts will work", path, error)
        return None
    # The engine checks every prompt against max_model_len itself (a 400 naming the limit); the tokenizer's
    # own limit would only log "will result in indexing errors" for each over-long prompt it encodes.
    tokenizer.model_max_length = sys.maxsize
    return tokenizer
