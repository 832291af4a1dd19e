"""`OffloadingConnector`: the native CPU tier (vLLM's connector of that name, `--kv-offloading-backend native`).

Saves a device block to host memory when the device cache evicts it, and on a device-cache miss loads the
following blocks back before the request's prefill is scheduled (the scheduler counts them as computed).
Extra config (vLLM's keys): `cpu_bytes_to_use` (the tier's bytes) or `num_cpu_blocks`, and `block_size`,
which must be the engine's (one tier block per device block).

Copies: gathered on the device into one staging tensor (one gather per layer), then one copy per block into
(or out of) the slot, which holds the block across every layer. On a CPU engine they are synchronous, inside
the step before the forward, and the slots are written (read) with one indexed copy for all the step's
blocks. On CUDA they are queued non-blocking on the current stream against pinned memory, so stream order
alone keeps them before the forward and the buffer's later reuse. The seam for a side stream overlapped with
the forward: `_write_blocks` / `_read_blocks` issue there and record events, `wait_for_layer_load` /
`wait_for_save` wait on them. (The CUDA path has not run on a GPU yet.)
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import torch

from ..sequence import Sequence
from .base import KVConnectorBase, KVConnectorMetadata
from .config import KVTransferConfig
from .cpu_tier import CPUBlockPool

logger = logging.getLogger(__name__)
EXTRA_KEYS = ("cpu_bytes_to_use", "num_cpu_blocks", "block_size")


class OffloadingConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, block_size: int, *, num_layers: int, num_kv_heads: int,
                 head_dim: int, cache_dtype: torch.dtype, device: torch.device,
                 block_key: Callable[[bytes | None, list[int], tuple[int, int]], bytes]) -> None:
        super().__init__(config, block_size)
        extra = config.kv_connector_extra_config
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ValueError(f"--kv-transfer-config: OffloadingConnector: unknown kv_connector_extra_config key(s) "
                             f"{unknown}; known: {list(EXTRA_KEYS)}")
        if extra.get("block_size", block_size) != block_size:
            raise ValueError(f"--kv-transfer-config: OffloadingConnector block_size {extra['block_size']} must equal "
                             f"the engine's --block-size {block_size}")
        self.device = device
        self.block_key = block_key  # the prefix cache's keys: its hits and the tier's are the same blocks
        element = torch.empty((), dtype=cache_dtype).element_size()
        # Raw words, not elements: copies are bit-exact for every cache dtype (8-bit ones included), and the
        # widest word that divides a head's row keeps indexed copies fast (uint8 ones run ~30x slower on a CPU).
        row = head_dim * element
        self.word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8)
                         if row % torch.empty((), dtype=w).element_size() == 0)
        slot_shape = (num_layers, 2, block_size, num_kv_heads, row // torch.empty((), dtype=self.word).element_size())
        slot_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * element
        num_slots = _num_slots(extra, slot_bytes)
        self.pool = CPUBlockPool(num_slots, slot_shape, self.word, pin_memory=device.type == "cuda")
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._match: tuple[Sequence, list[tuple[bytes, int]]] | None = None
        self._loads: list[tuple[str, int, int]] = []
        self._saves: list[tuple[int, int]] = []
        self._saved_hashes: dict[int, bytes] = {}  # slot -> hash of this step's saves (dropped if the save fails)
        self._failed: set[int] = set()
        logger.info("KV offloading: a CPU tier of %d blocks (%.2f GiB), %d layers per block", num_slots,
                    num_slots * slot_bytes / (1 << 30), num_layers)

    # -- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        self._match = None
        if not self.config.loads:
            return 0, False
        bs = self.block_size
        first, limit = num_computed_tokens // bs, (seq.num_tokens - 1) // bs
        parent = seq.block_hashes[first - 1] if first else None
        adapter = (seq.lora_id, seq.lora_generation)
        found: list[tuple[bytes, int]] = []
        for i in range(first, limit):
            block_hash = self.block_key(parent, seq.token_ids[i * bs:(i + 1) * bs], adapter)
            slot = self.pool.lookup(block_hash)
            if slot is None:
                break
            # Pinned now, not after the allocation: the device blocks that allocation evicts are saved to the
            # tier, and must not take the slot this load will read.
            self.pool.touch(block_hash)
            self.pool.pin(slot)
            found.append((block_hash, slot))
            parent = block_hash
        self._match = (seq, found)
        return len(found) * bs, False

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        found = self._match[1] if self._match is not None and self._match[0] is seq else []
        self._match = None
        if seq.num_preemptions == 0:
            self.stats.queries += seq.num_prompt_tokens
            self.stats.hits += num_external_tokens
        for block_id, (_block_hash, slot) in zip(block_ids, found[:num_external_tokens // self.block_size]):
            self._loads.append((seq.request_id, block_id, slot))

    def on_block_evicted(self, block_hash: bytes, block_id: int) -> None:
        if not self.config.saves:
            return
        slot = self.pool.allocate(block_hash)
        if slot is not None:
            self._saves.append((block_id, slot))
            self._saved_hashes[slot] = block_hash

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(self._loads, self._saves)
        self._loads, self._saves = [], []
        return meta

    def reset(self) -> None:
        self.pool.clear()

    # -- worker side --------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[tuple]) -> None:
        self.kv = [(k.view(self.word), v.view(self.word)) for k, v in kv_caches]

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        try:
            if meta.saves:
                self._save(meta.saves)
            for _request_id, group in itertools.groupby(meta.loads, key=lambda load: load[0]):
                loads = list(group)
                block_ids, slots = [b for _, b, _ in loads], [s for _, _, s in loads]
                try:
                    started = time.perf_counter()
                    self._read_blocks(block_ids, slots)
                    self.stats.seconds_loading += time.perf_counter() - started
                    self.stats.bytes_loaded += len(slots) * self.pool.slot_bytes
                except Exception:  # noqa: BLE001 -- one request's failed load is handled per the failure policy
                    logger.warning("KV offloading: loading %d blocks failed", len(block_ids), exc_info=True)
                    self._failed.update(block_ids)
        finally:
            self.pool.unpin_all()
            self._saved_hashes.clear()

    def _save(self, saves: list[tuple[int, int]]) -> None:
        started = time.perf_counter()
        try:
            self._write_blocks([b for b, _ in saves], [s for _, s in saves])
        except Exception:  # noqa: BLE001 -- a lost save costs a future hit, never a request
            logger.warning("KV offloading: saving %d blocks failed; they are dropped", len(saves), exc_info=True)
            for _, slot in saves:
                self.pool.discard(self._saved_hashes[slot])
            return
        self.stats.seconds_saving += time.perf_counter() - started
        self.stats.bytes_saved += len(saves) * self.pool.slot_bytes

    def _write_blocks(self, block_ids: list[int], slots: list[int]) -> None:
        """Device blocks -> tier slots. CPU: per layer, a gather from the cache and a scatter into the slots.
        CUDA: one gather per layer into a staging tensor on the device, then one copy per block."""
        ids = torch.tensor(block_ids, device=self.device)
        if self.device.type != "cuda":  # gather each layer's blocks and scatter them into the slots: two copies
            targets = torch.tensor(slots)
            for layer, (k, v) in enumerate(self.kv):
                self.pool.buffer[:, layer, 0].index_copy_(0, targets, k.index_select(0, ids))
                self.pool.buffer[:, layer, 1].index_copy_(0, targets, v.index_select(0, ids))
            return
        staged = torch.stack([torch.stack((k.index_select(0, ids), v.index_select(0, ids)), 1) for k, v in self.kv],
                             1)
        for i, slot in enumerate(slots):  # one DMA per block into pinned memory, queued on the current stream
            self.pool.buffer[slot].copy_(staged[i], non_blocking=True)

    def _read_blocks(self, block_ids: list[int], slots: list[int]) -> None:
        """Tier slots -> device blocks. CPU: per layer, a gather from the slots and a scatter into the cache.
        CUDA: one copy per block into a staging tensor on the device, then one scatter per layer."""
        ids = torch.tensor(block_ids, device=self.device)
        if self.device.type != "cuda":
            sources = torch.tensor(slots)
            for layer, (k, v) in enumerate(self.kv):
                k.index_copy_(0, ids, self.pool.buffer[:, layer, 0].index_select(0, sources))
                v.index_copy_(0, ids, self.pool.buffer[:, layer, 1].index_select(0, sources))
            return
        staged = torch.empty((len(slots), *self.pool.buffer.shape[1:]), dtype=self.word, device=self.device)
        for i, slot in enumerate(slots):
            staged[i].copy_(self.pool.buffer[slot], non_blocking=True)
        for layer, (k, v) in enumerate(self.kv):
            k.index_copy_(0, ids, staged[:, layer, 0])
            v.index_copy_(0, ids, staged[:, layer, 1])

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def occupancy(self) -> tuple[int, int]:
        return len(self.pool), self.pool.num_slots


def _num_slots(extra: dict, slot_bytes: int) -> int:
    has_bytes, has_blocks = "cpu_bytes_to_use" in extra, "num_cpu_blocks" in extra
    if has_bytes == has_blocks:
        raise ValueError("--kv-transfer-config: OffloadingConnector needs exactly one of cpu_bytes_to_use and "
                         "num_cpu_blocks in kv_connector_extra_config (or use --kv-offloading-size GiB)")
    key = "cpu_bytes_to_use" if has_bytes else "num_cpu_blocks"
    value = extra[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--kv-transfer-config: OffloadingConnector {key} must be a positive integer, got {value!r}")
    num_slots = value // slot_bytes if has_bytes else value
    if num_slots < 1:
        raise ValueError(f"--kv-offloading-size / cpu_bytes_to_use ({value} bytes) is smaller than one KV block "
                         f"across the offloaded layers ({slot_bytes} bytes)")
    return num_slots
