"""How the engine drives a KV connector: built at start (refusing setups it cannot serve), wired to the block
manager's evictions and the scheduler's admissions, and run once per step between scheduling and the forward.

A load that failed follows `kv_load_failure_policy`: "recompute" moves the request's computed tokens back to
its first failed block, so this step computes from there (its token count unchanged: a chunk of the prefill,
the rest next step) and the request's output is the one without a tier; "fail" ends the request with an
error. Either is counted.
"""
from __future__ import annotations

import logging

from ..sequence import ScheduledBatch
from .base import KVConnectorBase
from .registry import connector_factory
from .config import KVTransferConfig

logger = logging.getLogger(__name__)


def build_connector(config: KVTransferConfig, engine_config, spec, runner, block_manager) -> KVConnectorBase:
    """The connector the config names, registered on the runner's KV cache; ValueError for setups not served."""
    factory = connector_factory(config.kv_connector)
    if engine_config.world_size > 1:
        raise ValueError("--kv-transfer-config / --kv-offloading-size: not supported with tensor parallelism yet "
                         "(each rank would offload its own heads); use --tensor-parallel-size 1")
    if not engine_config.enable_prefix_caching:
        raise ValueError("--kv-transfer-config / --kv-offloading-size: the tier is keyed by the prefix cache's block "
                         "hashes; drop --no-enable-prefix-caching")
    if runner.window_pool:
        raise ValueError("--kv-transfer-config / --kv-offloading-size: not supported yet on models mixing windowed and "
                         "full-attention layers (Gemma 2/3, Qwen with max_window_layers): only the full-attention "
                         "pool would offload, and a reloaded prefix would lack its windowed layers' K/V")
    keys = runner.kv_caches[0][0]
    connector = factory(config, engine_config.block_size, num_layers=len(runner.kv_caches),
                        num_kv_heads=keys.shape[2], head_dim=keys.shape[3], cache_dtype=keys.dtype,
                        device=keys.device, block_key=block_manager.block_key)
    connector.register_kv_caches(runner.kv_caches)
    block_manager.on_evict = connector.on_block_evicted
    return connector


class KVTransferStep:
    def __init__(self, connector: KVConnectorBase, scheduler) -> None:
        self.connector = connector
        self.scheduler = scheduler
        scheduler.kv_connector = connector

    def run(self, batch: ScheduledBatch) -> None:
        """This step's saves and loads, before the forward; failed loads per the policy."""
        connector = self.connector
        meta = connector.build_connector_meta()
        connector.start_load_kv(meta)  # also when empty: it ends the step's pins (an admission that fell through)
        if not meta:
            return
        connector.wait_for_save()
        failed = connector.get_block_ids_with_load_errors()
        if failed:
            self._handle_failed_loads(batch, failed)

    def _handle_failed_loads(self, batch: ScheduledBatch, failed: set[int]) -> None:
        stats, bs = self.connector.stats, self.connector.block_size
        policy = self.connector.config.kv_load_failure_policy
        for entry in list(batch.entries):
            seq = entry[0]
            bad = next((i for i, block_id in enumerate(seq.block_table) if block_id in failed), None)
            if bad is None:
                continue
            stats.load_failures += 1
            if policy == "fail":
                batch.entries.remove(entry)
                self.scheduler.finish(seq, "abort", f"loading the request's KV blocks from the "
                                      f"{self.connector.config.kv_connector} tier failed "
                                      "(kv_load_failure_policy=fail)")
                batch.failed.append(seq)
            else:
                seq.num_computed_tokens = min(seq.num_computed_tokens, bad * bs)
                seq.num_cached_tokens = min(seq.num_cached_tokens, bad * bs)  # what the usage reports as cached
                stats.recomputed += 1
                logger.info("KV offloading: request %s recomputes from token %d (load failed)", seq.request_id,
                            bad * bs)
