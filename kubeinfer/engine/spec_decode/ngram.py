"""The n-gram proposer (vLLM's "ngram", a.k.a. prompt lookup decoding): find the sequence's last n tokens
earlier in the sequence (prompt or output) and propose what followed them there. Free to run, and right
often when the output copies from the input (editing, extraction, code, quoting).

Each sequence keeps an index of where every n-gram starts, extended by the tokens added since its last
proposal, so a proposal costs a few dict look-ups instead of a scan of the whole sequence (the scan took
~7% of a batch-1 step on the demo model)."""
from __future__ import annotations

import weakref


class NgramIndex:
    """Where each n-gram of a growing token list starts, for n in [min_n, max_n]. Only n-grams followed by at
    least one token are indexed (a match must have a continuation, and the suffix itself is no match)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.starts: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_n, max_n + 1)}
        self.covered = 0  # the token count the index was last extended to

    def extend(self, tokens: list[int]) -> None:
        length = len(tokens)
        if length < self.covered:  # not the list it indexed (token lists only grow): start over
            for starts in self.starts.values():
                starts.clear()
            self.covered = 0
        for n, starts in self.starts.items():
            # Starts s with s + n <= length - 1 are eligible; those up to covered - 1 - n are in already.
            for s in range(max(0, self.covered - n), length - n):
                starts.setdefault(tuple(tokens[s:s + n]), []).append(s)
        self.covered = length


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner (a Sequence) -> NgramIndex

    def propose(self, token_ids: list[int], num_tokens: int, owner: object | None = None) -> list[int]:
        """Up to `num_tokens` guesses of the tokens after `token_ids`; [] when no n-gram matches. Longer
        n-grams are tried first (a longer match predicts better). `owner` (the sequence whose tokens these
        are, growing between calls) keeps its index from one call to the next."""
        if num_tokens <= 0 or len(token_ids) <= self.min_n:
            return []
        index = self._indexes.get(owner) if owner is not None else None
        if index is None:
            index = NgramIndex(self.min_n, self.max_n)
            if owner is not None:
                self._indexes[owner] = index
        index.extend(token_ids)
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            starts = index.starts[n].get(tuple(token_ids[length - n:]))
            if not starts:
                continue
            # The most recent match with a full continuation; else the earliest (the longest continuation,
            # e.g. inside a run of one repeated token).
            begin = next((s for s in reversed(starts) if s + n + num_tokens <= length), starts[0]) + n
            return token_ids[begin:begin + num_tokens]
        return []
