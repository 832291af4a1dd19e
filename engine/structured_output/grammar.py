"""Compiling a request's constraint into llguidance grammars, and one matcher per sequence."""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict

import llguidance
import llguidance.hf
import llguidance.torch
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
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds = 0.0  # total, for the metrics
        self.compiles = 0

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one sequence; ValueError naming spec.field for a bad or unsupported grammar."""
        grammar = self._compiled(spec)
        return GrammarMatcher(llguidance.LLMatcher(self.tokenizer, grammar, log_level=0))

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

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed tokens into bitmask[row] (int32 words, bit i of word w is token 32w+i)."""
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept(self, token: int) -> bool:
        """Consumes a sampled token; False when the grammar does not allow it (the matcher is then broken)."""
        return self._matcher.consume_token(token)

    @property
    def is_finished(self) -> bool:
        """The document is complete: nothing but EOS may follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()
