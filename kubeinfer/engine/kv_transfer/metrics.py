"""/metrics series of a KV connector: vLLM's names where vLLM has them (external prefix-cache lookups,
offload transfer bytes and seconds per direction), ours for the tier's occupancy and load-failure fallbacks.
Exported only while a connector is configured, as vLLM does."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .base import KVConnectorBase

DIRECTIONS = ("CPU_to_GPU", "GPU_to_CPU")  # vLLM's transfer_type labels (GPU: the device tier, as in KV events)


def connector_metrics(connector: KVConnectorBase | None, name: list[str]) -> Iterator:
    if connector is None:
        return
    stats = connector.stats

    def family(kind, metric: str, doc: str, value: float):
        metric_family = kind(metric, doc, labels=["model_name"])
        metric_family.add_metric(name, value)
        return metric_family

    yield family(CounterMetricFamily, "vllm:external_prefix_cache_queries",
                 "Prompt tokens looked up in the KV connector's tier.", stats.queries)
    yield family(CounterMetricFamily, "vllm:external_prefix_cache_hits",
                 "Prompt tokens the KV connector's tier held (loaded instead of computed).", stats.hits)
    for metric, doc, values in (
            ("vllm:kv_offload_total_bytes", "Bytes of KV blocks moved between tiers.",
             (stats.bytes_loaded, stats.bytes_saved)),
            ("vllm:kv_offload_total_time", "Seconds spent moving KV blocks between tiers (on CUDA: queuing them).",
             (stats.seconds_loading, stats.seconds_saving))):
        by_direction = CounterMetricFamily(metric, doc, labels=["model_name", "transfer_type"])
        for direction, value in zip(DIRECTIONS, values):
            by_direction.add_metric(name + [direction], value)
        yield by_direction
    stored, capacity = connector.occupancy()
    yield family(GaugeMetricFamily, "kubeinfer:kv_offload_cpu_blocks", "KV blocks held in the CPU tier.", stored)
    yield family(GaugeMetricFamily, "kubeinfer:kv_offload_cpu_usage_perc", "Fraction of the CPU tier's blocks in use.",
                 stored / capacity if capacity else 0.0)
    yield family(CounterMetricFamily, "kubeinfer:kv_load_failures",
                 "Requests whose KV load from the tier failed.", stats.load_failures)
    yield family(CounterMetricFamily, "kubeinfer:kv_load_recomputed", "Requests that recomputed the tokens whose "
                 "load failed (kv_load_failure_policy=recompute).", stats.recomputed)
