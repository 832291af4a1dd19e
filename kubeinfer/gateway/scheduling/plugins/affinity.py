"""Rendezvous hashing of the prompt's opening over the candidates: a fixed, pseudo-random preference per
prompt family that every gateway replica computes alike, so replicas that share no state still send a new
prefix to the same pod (and, when it is busy, to the same second choice). A prompt too short to leave
reusable KV blocks gets no preference: it goes wherever load says."""
from __future__ import annotations

import numpy as np

from ..framework import Context, Scorer
from ..registry import register_scorer

AFFINITY_MIN_CHUNKS = 4  # 256 characters, about 64 tokens


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit moves every output bit (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@register_scorer("affinity")
class AffinityScorer(Scorer):
    def score(self, ctx: Context, rows: np.ndarray) -> np.ndarray:
        if len(ctx.request.prefix_hashes()) < AFFINITY_MIN_CHUNKS:
            return np.zeros(len(rows))
        mixed = mix64(ctx.table.address_keys[rows] ^ np.uint64(ctx.request.affinity_key()))
        return mixed.astype(np.float64) / 2.0 ** 64
