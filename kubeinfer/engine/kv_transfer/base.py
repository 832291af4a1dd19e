"""The KV connector interface, shaped like vLLM's v1 `KVConnectorBase_V1`, and the registry of connectors.

A connector is an external KV tier behind the device cache. Its scheduler side answers, on a request's
admission, how many tokens past the device-cached prefix the tier holds (`get_num_new_matched_tokens`),
learns which device blocks were allocated for them (`update_state_after_alloc`), hears of device blocks
about to be reused (`on_block_evicted`: save them now or lose them) and of finished requests
(`request_finished`), and packs one step's work into a `KVConnectorMetadata` (`build_connector_meta`).
Its worker side runs that work against the device cache before the step's forward: `start_load_kv`,
`wait_for_layer_load` (per layer, for connectors that overlap loads with the forward), `wait_for_save`,
then reports `get_finished` transfers and `get_block_ids_with_load_errors`. In this engine both sides live in
the scheduler's process (one object); a tensor-parallel worker would run the worker side on each rank.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from ..sequence import Sequence
from .config import KVTransferConfig


@dataclass
class KVConnectorMetadata:
    """One step's transfers. `loads`: (request_id, device block, tier slot); `saves`: (device block, tier slot).
    Saves run first: a block evicted and handed out again in the same step is read before it is written."""
    loads: list[tuple[str, int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


@dataclass
class KVConnectorStats:
    """Counters for /metrics: vLLM's external prefix-cache and offload-transfer series, and ours."""
    queries: int = 0  # prompt tokens looked up in the tier (vllm:external_prefix_cache_queries)
    hits: int = 0  # of those, tokens the tier held (vllm:external_prefix_cache_hits)
    bytes_loaded: int = 0  # vllm:kv_offload_total_bytes{transfer_type="CPU_to_GPU"}
    bytes_saved: int = 0  # ... {transfer_type="GPU_to_CPU"}
    seconds_loading: float = 0.0  # vllm:kv_offload_total_time{transfer_type=...}
    seconds_saving: float = 0.0
    load_failures: int = 0  # requests whose load failed (either policy)
    recomputed: int = 0  # of those, requests that recomputed the tokens instead (kubeinfer:kv_load_recomputed)


class KVConnectorBase(ABC):
    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.stats = KVConnectorStats()

    # -- scheduler side ---------------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past `num_computed_tokens` (the device-cached prefix) the tier can load, and whether the load
        is asynchronous (a request that must wait steps for it). Never the prompt's last token."""

    @abstractmethod
    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        """After the admission's allocation: `block_ids` are the device blocks to load the matched tokens into.
        Called on every successful admission, with 0 tokens when nothing matched."""

    def on_block_evicted(self, block_hash: bytes, block_id: int) -> None:
        """A cached device block is about to be handed out again: its contents are valid until this step's
        transfers and forward run."""

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> bool:
        """A request ended; True would mean the connector still reads its blocks (held until `get_finished`)."""
        return False

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """This step's transfers; the scheduler side's pending lists start over."""

    def reset(self) -> None:
        """Forget every stored block (the engine's prefix-cache reset)."""

    # -- worker side --------------------------------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_caches: list[tuple]) -> None:
        """The device cache: per layer (keys, values), each [num_blocks, block_size, kv_heads, head_dim]."""

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Start this step's saves and loads (saves first)."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until `layer`'s loads are in the device cache (no-op for a connector whose loads end in start)."""

    def wait_for_save(self) -> None:
        """Block until this step's saves no longer read the device cache."""

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous (saves, loads) finished since the last call."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks whose load failed since the last call: their tokens must be recomputed or the
        request failed, per `kv_load_failure_policy`."""
        return set()

    # -- state, for metrics -------------------------------------------------------------------------
    def occupancy(self) -> tuple[int, int]:
        """(blocks stored, blocks the tier can hold)."""
        return 0, 0
