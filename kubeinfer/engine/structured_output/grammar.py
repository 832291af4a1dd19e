"""Compiling a request's constraint into llguidance grammars, and one matcher per sequence."""
from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections import OrderedDict

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch

from ..sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)
# Compact JSON (no free whitespace between tokens): a model cannot pad a document forever, and the output
# is what json.dumps(separators=(",", ":")) writes.
JSON_OPTIONS = {"whitespace_flexible": False}
CACHE_SIZE = 256


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for a spec; ValueError naming spec.field when it cannot be read."""
    try:
        if spec.kind == "json":
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            if not isinstance(schema, dict):
                raise ValueError("the schema must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to it
    except (ValueError, TypeError) as error:
        raise ValueError(f"{spec.field}: {error}") from None


class GrammarCompiler:
    """Per engine: the tokenizer as llguidance sees it, and validated grammars cached by spec. Thread-safe:
    front ends compile while preparing requests, off the engine thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        # The grammar's vocabulary covers every id either side knows: the model's logits may be wider than the
        # tokenizer (a padded vocab_size) or narrower (tokens added to the tokenizer only); llguidance refuses
        # an n_vocab below the tokenizer's length. The mask is this wide; the sampler fits it to the logits.
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(vocab_size, len(tokenizer)),
                                                      eos_token=sorted(eos_token_ids) or None)
        self.vocab_size = self.tokenizer.vocab_size
        # The ids llguidance has no text for (special tokens, padding ids): the only ones its mask and its
        # matcher can disagree on (see GrammarMatcher.fill_bitmask).
        self.special_ids = np.array([t for t in range(self.vocab_size) if self.tokenizer.is_special_token(t)],
                                    dtype=np.int64)
        self.special_words = self.special_ids >> 5  # where their bits are in a mask row
        self.special_bits = (np.uint32(1) << (self.special_ids & 31).astype(np.uint32)).astype(np.uint32)
        # A private copy that reads a special token's name as text (and is not shared with other threads).
        self._plain_text = copy.copy(tokenizer.backend_tokenizer)
        self._plain_text.no_padding()
        self._plain_text.no_truncation()
        self._plain_text.encode_special_tokens = True
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds = 0.0  # total, for the metrics
        self.compiles = 0

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one sequence; ValueError naming spec.field for a bad or unsupported grammar."""
        grammar = self._compiled(spec)
        return GrammarMatcher(llguidance.LLMatcher(self.tokenizer, grammar, log_level=0), self)

    def text_tokens(self, data: bytes) -> list[int]:
        """`data` tokenized as plain text: an added special token's name is spelled out, not matched."""
        return self._plain_text.encode(data.decode("utf-8", errors="ignore"), add_special_tokens=False).ids

    def _compiled(self, spec: StructuredOutputsParams) -> str:
        key = json.dumps([spec.kind, spec.json, spec.regex, spec.choice, spec.grammar], sort_keys=True, default=str)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        started = time.perf_counter()
        grammar = grammar_text(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"{spec.field}: {messages[0] if messages else 'invalid grammar'}")
        with self._lock:
            self.compile_seconds += time.perf_counter() - started
            self.compiles += 1
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


class GrammarMatcher:
    """Which tokens may come next in one sequence, and what it has consumed."""

    def __init__(self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler) -> None:
        self._matcher = matcher
        self._compiler = compiler
        self.vocab_size = compiler.vocab_size  # the bitmask's width in tokens
        self._failure: str | None = None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed tokens into bitmask[row] (int32 words, bit i of word w is token 32w+i).

        When the grammar forces a text, llguidance's mask allows only the first token of that text as its
        tokenizer splits it, and the tokenizer maps "<tool_call>" to an added special token of that name, which
        llguidance's own matcher then refuses (to the grammar a special token is not text). So every allowed
        special id is checked against the matcher and cleared if refused, and the forced text's first token
        as plain text takes its place: the mask allows only what `accept` takes. Only EOS, at the end, is
        usually among them, so this costs a gather per step."""
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)
        compiler = self._compiler
        unsigned = bitmask.numpy()[row].view(np.uint32)  # the same memory; bit 31 of an int32 word is its sign
        hits = np.flatnonzero(unsigned[compiler.special_words] & compiler.special_bits)
        if not len(hits):
            return
        allowed = compiler.special_ids[hits].tolist()
        refused = [t for t in allowed if self._matcher.validate_tokens([t]) != 1]
        for token in refused:
            unsigned[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
        if refused:
            text = self._compiler.text_tokens(self._matcher.compute_ff_bytes())
            if text and text[0] < self.vocab_size and self._matcher.validate_tokens(text[:1]) == 1:
                unsigned[text[0] >> 5] |= np.uint32(1 << (text[0] & 31))

    def fail(self, reason: str) -> None:
        """Its mask could not be computed: the sequence's next token ends it with this error (see `accept`)."""
        self._failure = reason

    def accept(self, token: int) -> bool:
        """Consumes a sampled token; False when the grammar does not allow it (the matcher is then broken)."""
        return self._failure is None and self._matcher.consume_token(token)

    @property
    def is_finished(self) -> bool:
        """The document is complete: nothing but EOS may follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        """The reason, in one line (llguidance appends its parser state and the whole grammar)."""
        return self._failure or next(iter(self._matcher.get_error().splitlines()), "")
