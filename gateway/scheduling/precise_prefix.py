"""The precise prefix scorer: how many of a request's leading KV blocks each pod really holds.

The block index (datastore/kv_block_index.py) follows the engines' KV events; this hashes the request's
token ids into the same chained keys, block by block, and walks them per candidate: the longest leading
run held on the device counts fully, a further run held only in an offloaded tier counts half (it must be
loaded back, still far cheaper than a prefill). A pod the gateway just sent a prefix to holds it before
its events say so (the prefill is still running): each pick leaves a short-lived entry for that pod and
the request's keys, so a burst of one group's requests does not scatter before the first event arrives.

The adapter is part of the key (the engine's cache keeps an adapter's blocks apart from the base
model's): a request for a model no pod serves as its base is keyed by that adapter's name, as the
engine's `lora_name`.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from ..datastore.kv_block_index import KVBlockIndex, chain_keys
from .prompt_tokens import Tokenizers

OFFLOADED_WEIGHT = 0.5  # a block to load back from an offloaded tier, against one already on the device
INFLIGHT_TTL = 2.0  # seconds a routed prefix counts as held before its BlockStored events arrive
INFLIGHT_PER_POD = 50_000  # bound on the in-flight keys kept per pod


class PrecisePrefixScorer:
    def __init__(self, index: KVBlockIndex, tokenizers: Tokenizers, inflight_ttl: float = INFLIGHT_TTL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index, self.tokenizers, self.inflight_ttl, self.clock = index, tokenizers, inflight_ttl, clock
        self._inflight: dict[str, OrderedDict[int, float]] = {}  # pod -> key -> expiry, oldest first

    def tokenize(self, request) -> list[int] | None:
        """The request's prompt token ids (cached on it); None when this gateway cannot know them."""
        if request.token_ids is None and request.body is not None:
            request.token_ids = self.tokenizers.prompt_ids(request.model, request.body) or []
            request.body = None  # tokenized: the parsed body need not live as long as the request
        return request.token_ids or None

    def keys(self, request, lora: str | None) -> list[int] | None:
        tokens = self.tokenize(request)
        with self.index.lock:
            sizes = list(self.index.block_sizes)
        if tokens is None or not sizes:
            return None
        return chain_keys(tokens, sizes[0], lora)  # one block size per fleet (ours and vLLM's default: 16)

    def tracks(self, pod: str) -> bool:
        return pod in self.index.pods

    def matched(self, keys: list[int], pods: list[str]) -> dict[str, float]:
        """Per pod, its leading blocks in block units: device run + OFFLOADED_WEIGHT x the offloaded rest,
        at least the in-flight run of a prefix just routed there."""
        runs = self.index.leading_runs(keys, pods)
        now = self.clock()
        out = {}
        for pod in pods:
            device, anywhere = runs.get(pod, (0, 0))
            score = device + OFFLOADED_WEIGHT * (anywhere - device)
            pending = self._inflight.get(pod)
            if pending:
                run = 0
                for key in keys:
                    if pending.get(key, 0.0) <= now:
                        break
                    run += 1
                score = max(score, run)
            if score:
                out[pod] = score
        return out

    def remember(self, pod: str, keys: list[int]) -> None:
        pending = self._inflight.setdefault(pod, OrderedDict())
        now = self.clock()
        expiry = now + self.inflight_ttl
        for key in keys:
            pending[key] = expiry
            pending.move_to_end(key)
        while pending and (len(pending) > INFLIGHT_PER_POD or next(iter(pending.values())) <= now):
            pending.popitem(last=False)
