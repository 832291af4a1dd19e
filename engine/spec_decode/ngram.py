"""The n-gram proposer (vLLM's "ngram", a.k.a. prompt lookup decoding): find the sequence's last n tokens
earlier in the sequence (prompt or output) and propose what followed them there. Free to run, and right
often when the output copies from the input (editing, extraction, code, quoting)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` guesses of the tokens after `token_ids`; [] when no n-gram matches. Longer
        n-grams are tried first (a longer match predicts better)."""
        if num_tokens <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows of tokens[:-1]: every match is followed by at least one token, and the suffix itself is out.
            windows = sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if not starts.size:
                continue
            # The most recent match with a full continuation; else the earliest (the longest continuation,
            # e.g. inside a run of one repeated token).
            full = starts[starts + n + num_tokens <= length]
            begin = (full[-1] if full.size else starts[0]) + n
            return tokens[begin:begin + num_tokens].tolist()
        return []
