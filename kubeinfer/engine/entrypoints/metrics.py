"""Prometheus metrics under vLLM's names, so the Gateway API Inference Extension, vLLM dashboards and
our own gateway read us unchanged. Every series carries `model_name`.

Gauges and counters that mirror engine state are read at scrape time (a collector), so they can never
drift from what the engine did; latency histograms are fed per request from the engine loop.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..core.async_engine import AsyncEngine
from ..core.outputs import RequestOutput
from ..platforms.cpu.native import ops as cpu_native
from ..kv_transfer.metrics import connector_metrics
from .openai.protocol_base import IGNORED_FIELDS

disable_created_metrics()  # the *_created series only add noise to every scrape

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class EngineMetrics:
    def __init__(self, async_engine: AsyncEngine, model_name: str) -> None:
        self.async_engine = async_engine
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(self))
        self.success_by_reason: dict[str, int] = {}
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time a request waited before it first ran.",
                                    LATENCY_BUCKETS)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Generated tokens per finished request.",
                                           TOKEN_BUCKETS)
        self._progress: dict[str, tuple[int, float]] = {}  # request -> (tokens seen, time of last token)
        async_engine.output_observers.append(self.observe)
        async_engine.abort_observers.append(self.on_abort)

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Called on the engine thread after every step with the requests that progressed."""
        now = time.monotonic()
        for output in outputs:
            m = output.metrics
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            seen, last = self._progress.get(output.request_id, (0, None))
            if last is None and num_tokens:
                self.ttft.observe(m["first_token_time"] - m["arrival_time"])
                if m.get("first_scheduled_time") is not None:
                    self.queue_time.observe(m["first_scheduled_time"] - m["arrival_time"])
            elif num_tokens > seen:
                gap = (now - last) / (num_tokens - seen)
                for _ in range(num_tokens - seen):
                    self.itl.observe(gap)
            self._progress[output.request_id] = (num_tokens, now)
            if output.finished:
                del self._progress[output.request_id]
                self.e2e.observe(now - m["arrival_time"])
                self.prompt_tokens.observe(len(output.prompt_token_ids))
                self.generation_tokens.observe(num_tokens)
                for completion in output.outputs:
                    reason = completion.finish_reason or "abort"
                    self.success_by_reason[reason] = self.success_by_reason.get(reason, 0) + 1

    def on_abort(self, request_id: str) -> None:
        """An aborted request produces no final output: count it here."""
        self._progress.pop(request_id, None)
        self.success_by_reason["abort"] = self.success_by_reason.get("abort", 0) + 1


class _StateCollector:
    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        engine = m.async_engine.engine
        name = [m.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", m.async_engine.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to run.", m.async_engine.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", engine.block_manager.usage)
        info = GaugeMetricFamily("vllm:cache_config_info", "KV-cache configuration.",
                                 labels=["model_name", "block_size", "num_gpu_blocks", "cache_dtype"])
        info.add_metric(name + [str(engine.config.block_size), str(engine.num_kv_blocks), engine.config.kv_cache_dtype], 1)
        yield info
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters.",
                                 labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        running, waiting = engine.lora_adapter_names()
        lora.add_metric(name + [",".join(running), ",".join(waiting), str(engine.config.max_loras if engine.config.enable_lora else 0)],
                        time.time())
        yield lora
        yield counter("vllm:prompt_tokens", "Prompt tokens processed.", engine.num_prompt_tokens)
        yield counter("vllm:generation_tokens", "Tokens generated.", engine.num_generation_tokens)
        yield counter("vllm:num_preemptions", "Sequences preempted: for lack of KV blocks, or (--scheduling-policy priority) for a more urgent request.", engine.scheduler.num_preemptions)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      engine.block_manager.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", engine.block_manager.prefix_hits)
        yield counter("kubeinfer:structured_output_requests", "Requests whose output a grammar constrained "
                      "(response_format, structured_outputs, guided_*, required or named tool calls).",
                      engine.num_structured_requests)
        compiler = engine.grammar_compiler
        yield counter("kubeinfer:grammar_compiles", "Grammars compiled (cache misses).", compiler.compiles if compiler else 0)
        yield counter("kubeinfer:grammar_compile_seconds", "Time spent compiling grammars.",
                      compiler.compile_seconds if compiler else 0.0)
        yield counter("kubeinfer:request_fields_ignored", "Unknown request body fields ignored (named in a warning).",
                      IGNORED_FIELDS.total)
        yield from _spec_decode_counters(engine.speculator, name)
        yield from cpu_native_kernels(name)
        tier = getattr(engine, "kv_transfer", None)  # --kv-transfer-config / --kv-offloading-size
        yield from connector_metrics(tier.connector if tier is not None else None, name)
        if engine.kv_events is not None:  # --kv-events-config: batches sent, and dropped rather than stall a step
            publisher = engine.kv_events.publisher
            yield counter("kubeinfer:kv_events_published", "KV-event batches published.", publisher.published)
            yield counter("kubeinfer:kv_events_dropped", "KV-event batches dropped (queue full or socket would block).",
                          publisher.dropped)
            if publisher.zap is not None:  # CURVE (the engine has an API key)
                yield counter("kubeinfer:kv_events_subscribers_refused", "KV-event subscribers refused for lacking "
                              "the gateway's key (CURVE).", publisher.zap.refused)
            if publisher.replay is not None:
                yield counter("kubeinfer:kv_events_replays_refused", "KV-event replay requests left unanswered: "
                              "too many clients, or the batches held for them at their bound.",
                              publisher.replay.stats.refused)
        success = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason in ("stop", "length", "abort"):
            success.add_metric(name + [reason], m.success_by_reason.get(reason, 0))
        yield success


def cpu_native_kernels(name: list[str]):
    """kubeinfer:cpu_native_kernels_info{level}: the native CPU kernels' build this engine loaded (build.py's
    level), once a CPU engine asked for them; nothing before (a GPU engine never does)."""
    level = cpu_native.level()
    if level is not None:
        kernels = GaugeMetricFamily("kubeinfer:cpu_native_kernels_info", "The native CPU kernels' build this "
                                    "engine loaded: level v4, v3, portable or native; torch where none loads.",
                                    labels=["model_name", "level"])
        kernels.add_metric(name + [level], 1)
        yield kernels


def _spec_decode_counters(speculator, name: list[str]):
    """vLLM's speculative-decoding counters; zero when speculation is off, so dashboards find every series."""
    values = ((speculator.num_drafts, speculator.num_draft_tokens, speculator.num_accepted_tokens)
              if speculator is not None else (0, 0, 0))
    for metric, doc, value in zip(("drafts", "draft_tokens", "accepted_tokens"),
                                  ("Verification steps with draft tokens.", "Draft tokens verified.",
                                   "Draft tokens accepted."), values):
        family = CounterMetricFamily(f"vllm:spec_decode_num_{metric}", doc, labels=["model_name"])
        family.add_metric(name, value)
        yield family
    per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                       "Draft tokens accepted, by their position in the draft.",
                                       labels=["model_name", "position"])
    for position, value in enumerate(speculator.accepted_per_position if speculator is not None else []):
        per_position.add_metric(name + [str(position)], value)
    yield per_position
