"""Prefix-cache affinity without the engine's tokenizer.

The gateway cannot see an engine's KV cache, but it knows where it sent each prompt. A prompt is cut
into fixed-size chunks of characters, each named by a hash chained over everything before it (as the
engine names KV blocks), and after routing the chunks are remembered for the chosen endpoint. The
next prompt scores each endpoint by how many of its leading chunks that endpoint has seen: a long
shared prefix goes back to the pod that most likely still holds its KV blocks. Memory is bounded per
endpoint (least recently used chunks are forgotten first), as the engine's cache is.

Two choices keep a pick cheap at hundreds of endpoints:
  * the chunk hash is Python's own `hash()` (SipHash, randomised per process), about 4x faster than
    blake2b. Unlike the engine's block keys (sha256: a collision there would serve wrong KV), a
    collision here only sends one request to a pod without its prefix, and the index never leaves
    this process, so a per-process seed is fine;
  * besides each endpoint's chunks the index keeps, per chunk, the endpoints that hold it, so matching
    a prompt against every endpoint walks the prompt's chunks once, not every endpoint.
A prompt's chunks are remembered last-to-first, so its leading chunks are the most recently used and
are evicted last (the engine's LRU frees a sequence's blocks tail first, for the same reason): an
endpoint that holds chunk k of a chain then also holds chunks 0..k-1.
"""
from __future__ import annotations

import hashlib
from itertools import islice

DEFAULT_CHUNK_CHARS = 64  # about 16 tokens: one engine KV block
DEFAULT_CAPACITY = 50_000  # chunks remembered per endpoint


def chunk_hashes(model: str, prompt: str, chunk_chars: int = DEFAULT_CHUNK_CHARS, limit: int = 512) -> list[int]:
    """Chained hashes of the prompt's full chunks; the model (adapter) is part of the chain, since
    engines never share KV blocks across adapters."""
    hashes = []
    parent = hash(("kubeinfer-prefix", model))
    for start in range(0, min(len(prompt), chunk_chars * limit) - chunk_chars + 1, chunk_chars):
        parent = hash((parent, prompt[start:start + chunk_chars]))
        hashes.append(parent)
    return hashes


AFFINITY_CHARS = 1024  # about 256 tokens: prompts that share this much share KV blocks worth a home


def affinity_key(model: str, prompt: str, chars: int = AFFINITY_CHARS) -> int:
    """A 64-bit name of the prompt's opening, the same in every gateway replica (unlike `chunk_hashes`):
    replicas that have never seen a prefix still agree on where it should live (rendezvous hashing)."""
    digest = hashlib.blake2b(f"{model}\0{prompt[:chars]}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class PrefixIndex:
    def __init__(self, capacity_per_endpoint: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity_per_endpoint
        self._seen: dict[str, dict[int, None]] = {}  # address -> its chunks, least recently used first
        self._holders: dict[int, set[str]] = {}  # chunk -> the addresses that hold it

    def match_counts(self, hashes: list[int]) -> dict[str, int]:
        """How many leading chunks of the prompt each endpoint holds (endpoints holding none are left out).
        Walks from the deepest chunk back: each endpoint is counted at the deepest chunk it holds, and
        the walk stops once every holder of the first chunk is counted."""
        first = self._holders.get(hashes[0]) if hashes else None
        if not first:
            return {}
        counts: dict[str, int] = {}
        for depth in range(len(hashes), 0, -1):
            holders = self._holders.get(hashes[depth - 1])
            if holders:
                for address in holders:
                    if address not in counts:
                        counts[address] = depth
                if len(counts) >= len(first):
                    break
        return counts

    def match_fraction(self, address: str, hashes: list[int]) -> float:
        """Fraction of the prompt's chunks that form a prefix this endpoint has already been sent."""
        seen = self._seen.get(address)
        if not hashes or not seen:
            return 0.0
        matched = 0
        for h in hashes:  # chained: the first miss ends the shared prefix
            if h not in seen:
                break
            matched += 1
        return matched / len(hashes)

    def remember(self, address: str, hashes: list[int]) -> None:
        seen, holders = self._seen.setdefault(address, {}), self._holders
        for h in reversed(hashes):  # the leading chunks end up most recently used
            if h in seen:
                del seen[h]  # re-inserted below: a dict keeps insertion order, so this moves it to the end
            elif h in holders:
                holders[h].add(address)
            else:
                holders[h] = {address}
            seen[h] = None
        excess = len(seen) - self.capacity
        if excess > 0:
            for h in list(islice(seen, excess)):
                del seen[h]
                self._release(h, address)

    def _release(self, h: int, address: str) -> None:
        holders = self._holders[h]
        holders.discard(address)
        if not holders:
            del self._holders[h]

    def forget(self, address: str) -> None:
        """The endpoint left the pool (its cache left with it)."""
        for h in self._seen.pop(address, {}):
            self._release(h, address)

    def retain_only(self, addresses: set[str]) -> None:
        for address in [a for a in self._seen if a not in addresses]:
            self.forget(address)
