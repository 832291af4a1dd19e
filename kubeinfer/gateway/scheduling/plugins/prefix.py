"""The prefix scorer: the share of the prompt's leading chunks already sent to each endpoint (its likely
cached prefix, scheduling/prefix.py); with --prefix-routing precise, the share of its leading KV blocks the
pod holds by its KV events (scheduling/precise_prefix.py), for the pods whose events the gateway follows,
and the approximate share for the others. The plugin owns what it learns: after each pick it remembers where
the prompt went (pre_request), in the index the picker shares with it (PluginHandle.prefix_index)."""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ...datastore.endpoints import Endpoint
from ..framework import Context, PluginHandle, Scorer
from ..registry import register_scorer

logger = logging.getLogger(__name__)
BLOCK_KEYS = "prefix.block_keys"  # Context.state: the request's KV block keys, when scored precisely


@register_scorer("prefix")
class PrefixScorer(Scorer):
    def __init__(self, parameters: dict[str, Any] | None = None, handle: PluginHandle | None = None) -> None:
        super().__init__(parameters, handle)
        self.index, self.precise = self.handle.prefix_index, self.handle.precise
        self._approximate_logged = False

    def score(self, ctx: Context, rows: np.ndarray) -> np.ndarray:
        table, hashes = ctx.table, ctx.request.prefix_hashes()
        block_keys = ctx.state[BLOCK_KEYS] = self._block_keys(ctx)
        matched = np.zeros(len(table.endpoints))
        for address, count in self.index.match_counts(hashes).items():
            row = table.rows.get(address)
            if row is not None:
                matched[row] = count
        share = matched[rows] / max(1, len(hashes))
        if block_keys is None:
            return share
        # Precise where the pod's events are followed; the approximate share for the others.
        addresses = [table.endpoints[row].address for row in rows]
        held = self.precise.matched(block_keys, addresses)
        blocks = max(1, len(block_keys))
        return np.array([held.get(a, 0.0) / blocks if self.precise.tracks(a) or a in held else share[i]
                         for i, a in enumerate(addresses)])

    def pre_request(self, ctx: Context, endpoint: Endpoint) -> None:
        self.index.remember(endpoint.address, ctx.request.prefix_hashes())
        if block_keys := ctx.state.get(BLOCK_KEYS):
            self.precise.remember(endpoint.address, block_keys)

    def _block_keys(self, ctx: Context) -> list[int] | None:
        """The request's KV block keys for precise scoring; None (approximate) when precise routing is off,
        or no engine's events are followed yet, or the prompt cannot be tokenized here."""
        request = ctx.request
        if self.precise is None or (request.body is None and request.token_ids is None):
            return None
        lora = None if not request.model or ctx.table.base.mask(request.model).any() else request.model
        keys = self.precise.keys(request, lora)
        if keys is None and not self._approximate_logged:
            self._approximate_logged = True
            logger.warning("--prefix-routing precise: %s; scoring prefixes approximately until then",
                           "no engine publishes KV events yet" if not self.precise.index.block_sizes else
                           f"no tokenizer for `{request.model}` (--tokenizer)")
        return keys
