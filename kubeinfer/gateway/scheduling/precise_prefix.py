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

Requests are keyed with the block size most pods report; a pod with another size is not tracked (scored
approximately). Whatever goes wrong here (the index holds what engines sent) is logged once and scores the
request approximately: never an error for the request.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from ..datastore.kv_block_index import KVBlockIndex, chain_keys
from .prompt_tokens import Tokenizers

logger = logging.getLogger(__name__)

OFFLOADED_WEIGHT = 0.5  # a block to load back from an offloaded tier, against one already on the device
INFLIGHT_TTL = 2.0  # seconds a routed prefix counts as held before its BlockStored events arrive
INFLIGHT_PER_POD = 50_000  # bound on the in-flight keys kept per pod


class PrecisePrefixScorer:
    def __init__(self, index: KVBlockIndex, tokenizers: Tokenizers, inflight_ttl: float = INFLIGHT_TTL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index, self.tokenizers, self.inflight_ttl, self.clock = index, tokenizers, inflight_ttl, clock
        self._inflight: dict[str, OrderedDict[int, float]] = {}  # pod -> key -> expiry, oldest first
        self._block_size: int | None = None  # of the last keys made: which pods are tracked
        self._failed_logged = False

    def tokenize(self, request) -> list[int] | None:
        """The request's prompt token ids (cached on it); None when this gateway cannot know them."""
        if request.token_ids is None and request.body is not None:
            request.token_ids = self.tokenizers.prompt_ids(request.model, request.body) or []
            request.body = None  # tokenized: the parsed body need not live as long as the request
        return request.token_ids or None

    def keys(self, request, lora: str | None) -> list[int] | None:
        tokens = self.tokenize(request)
        size = self.index.block_size()
        if tokens is None or size is None:
            return None
        try:
            keys = chain_keys(tokens, size, lora)
        except Exception as error:  # noqa: BLE001 -- precise routing is a refinement: approximate instead
            self._failed(error)
            return None
        self._block_size = size
        return keys

    def tracks(self, pod: str) -> bool:
        return self.index.tracks(pod, self._block_size)

    def _failed(self, error: Exception) -> None:
        if not self._failed_logged:
            self._failed_logged = True
            logger.warning("precise prefix scoring failed (%s: %s); such requests are scored approximately",
                           type(error).__name__, error)

    def matched(self, keys: list[int], pods: list[str]) -> dict[str, float]:
        """Per pod, its leading blocks in block units: device run + OFFLOADED_WEIGHT x the offloaded rest,
        at least the in-flight run of a prefix just routed there."""
        try:
            runs = self.index.leading_runs(keys, pods)
        except Exception as error:  # noqa: BLE001 -- see keys()
            self._failed(error)
            runs = {}
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
