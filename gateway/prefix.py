"""Prefix-cache affinity without the engine's tokenizer.

The gateway cannot see an engine's KV cache, but it knows where it sent each prompt. A prompt is cut
into fixed-size chunks of characters, each named by a hash chained over everything before it (as the
engine names KV blocks), and after routing the chunks are remembered for the chosen endpoint. The
next prompt scores each endpoint by how many of its leading chunks that endpoint has seen: a long
shared prefix goes back to the pod that most likely still holds its KV blocks. Memory is bounded per
endpoint (least recently used chunks are forgotten first), as the engine's cache is.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

DEFAULT_CHUNK_CHARS = 64  # about 16 tokens: one engine KV block
DEFAULT_CAPACITY = 50_000  # chunks remembered per endpoint


def chunk_hashes(model: str, prompt: str, chunk_chars: int = DEFAULT_CHUNK_CHARS, limit: int = 512) -> list[bytes]:
    """Chained hashes of the prompt's full chunks; the model (adapter) is part of the chain, since
    engines never share KV blocks across adapters."""
    hashes = []
    parent = hashlib.blake2b(model.encode(), digest_size=8).digest()
    for start in range(0, min(len(prompt), chunk_chars * limit) - chunk_chars + 1, chunk_chars):
        parent = hashlib.blake2b(parent + prompt[start:start + chunk_chars].encode(), digest_size=8).digest()
        hashes.append(parent)
    return hashes


class PrefixIndex:
    def __init__(self, capacity_per_endpoint: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity_per_endpoint
        self._seen: dict[str, OrderedDict[bytes, None]] = {}

    def match_fraction(self, address: str, hashes: list[bytes]) -> float:
        """Fraction of the prompt's chunks that form a prefix this endpoint has already been sent."""
        if not hashes:
            return 0.0
        seen = self._seen.get(address)
        if not seen:
            return 0.0
        matched = 0
        for h in hashes:  # chained: the first miss ends the shared prefix
            if h not in seen:
                break
            matched += 1
        return matched / len(hashes)

    def remember(self, address: str, hashes: list[bytes]) -> None:
        seen = self._seen.setdefault(address, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def forget(self, address: str) -> None:
        """The endpoint left the pool (its cache left with it)."""
        self._seen.pop(address, None)

    def retain_only(self, addresses: set[str]) -> None:
        for address in [a for a in self._seen if a not in addresses]:
            del self._seen[address]
