"""The gateway's own Prometheus metrics, under the Gateway API Inference Extension's names.

Pool gauges are computed from the endpoint pool at scrape time; request counters and latency
histograms are fed as requests are routed (ext_proc) or proxied.

Cardinality stays bounded whatever clients send: a `model_name` label is a name some endpoint serves
or is assigned (anything else counts under UNKNOWN_MODEL), `endpoint` series are removed when their
endpoint leaves the pool, and `reason` takes a fixed set of values.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..scheduling.picker import Picker

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
UNKNOWN_MODEL = "unknown"  # the label of requests for models no endpoint serves
PICK_BUCKETS = (0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)


class GatewayMetrics:
    def __init__(self, picker: Picker, pool_name: str = "default") -> None:
        self.picker, self.pool_name = picker, pool_name
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(self))
        r = self.registry
        self.requests = Counter("inference_model_request", "Requests routed, by requested model.", ["model_name"],
                                registry=r)
        self.errors = Counter("inference_model_request_error", "Requests refused or failed, by HTTP status.",
                              ["model_name", "error_code"], registry=r)
        self.duration = Histogram("inference_model_request_duration_seconds",
                                  "End-to-end latency of proxied requests.", ["model_name"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.pick_duration = Histogram("kubeinfer_gateway_pick_duration_seconds",
                                       "Time the picker takes to choose an endpoint.", buckets=PICK_BUCKETS, registry=r)
        self.picks = Counter("kubeinfer_gateway_picks", "Routing decisions, by chosen endpoint.", ["endpoint"],
                             registry=r)
        self.retries = Counter("kubeinfer_gateway_retries", "Attempts moved to another endpoint, by why.", ["reason"],
                               registry=r)
        self.cancelled = Counter("kubeinfer_gateway_requests_cancelled", "Requests their client abandoned.",
                                 ["model_name"], registry=r)
        self.held = Gauge("kubeinfer_gateway_requests_held", "Requests waiting for a model with no ready engine "
                          "(scaled to zero, or starting).", registry=r)
        self.hold_seconds = Histogram("kubeinfer_gateway_hold_duration_seconds", "Time requests waited for an engine "
                                      "before they were routed.", ["model_name"], buckets=LATENCY_BUCKETS, registry=r)
        self.scale_ups = Counter("kubeinfer_gateway_scale_ups", "Scale-ups asked through an InferenceModel's /scale "
                                 "for a held request.", ["model_name"], registry=r)
        self.fallbacks = Counter("kubeinfer_gateway_fallbacks", "Requests served by a fallback model, by why "
                                 "(no_ready_endpoint, saturated, failed).", ["model_name", "fallback", "reason"],
                                 registry=r)
        self.queued = Gauge("kubeinfer_gateway_requests_queued", "Requests waiting in the gateway's fair queue for "
                            "a pod of their model to drop below the saturation thresholds.", registry=r)
        tenant = ["tenant", "model_name"]  # tenant: only names from the tenants file (usage.py)
        self.tenant_requests = Counter("kubeinfer_gateway_tenant_requests", "Requests per tenant and model, by HTTP "
                                       "status (the gateway's 429 refusals included).", [*tenant, "code"], registry=r)
        self.tenant_prompt_tokens = Counter("kubeinfer_gateway_tenant_prompt_tokens", "Prompt tokens the engines "
                                            "reported, per tenant.", tenant, registry=r)
        self.tenant_cached_tokens = Counter("kubeinfer_gateway_tenant_cached_prompt_tokens", "Prompt tokens served "
                                            "from the engines' prefix cache, per tenant.", tenant, registry=r)
        self.tenant_completion_tokens = Counter("kubeinfer_gateway_tenant_completion_tokens", "Completion tokens the "
                                                "engines reported, per tenant.", tenant, registry=r)
        self.tenant_engine_seconds = Counter("kubeinfer_gateway_tenant_engine_seconds", "Seconds from dispatch to the "
                                             "end of the response, summed per tenant.", tenant, registry=r)
        self._pick_labels: set[str] = set()
        self.discovery = None  # the Kubernetes pod discovery, when there is one: its failures are exported
        self.kv_events = None  # the KV-event subscriber (--prefix-routing precise): its counts are exported

    def count_pick(self, address: str) -> None:
        self._pick_labels.add(address)
        self.picks.labels(address).inc()

    def retain_endpoints(self, addresses: set[str]) -> None:
        """Drop the series of endpoints that left the pool: pod IPs churn, series must not pile up."""
        for address in self._pick_labels - addresses:
            self.picks.remove(address)
        self._pick_labels &= addresses


class _PoolCollector:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        picker = self.metrics.picker
        ready = picker.ready_endpoints()
        label = [self.metrics.pool_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["name"])
            family.add_metric(label, value)
            return family

        queue = sum(e.state.waiting for e in ready) / len(ready) if ready else 0.0
        kv = sum(e.state.kv_usage for e in ready) / len(ready) if ready else 0.0
        yield gauge("inference_pool_average_queue_size", "Average waiting requests over ready endpoints.", queue)
        yield gauge("inference_pool_average_kv_cache_utilization", "Average KV-cache usage over ready endpoints.", kv)
        yield gauge("inference_pool_ready_pods", "Endpoints ready to take requests.", len(ready))
        discovery = self.metrics.discovery
        if discovery is not None:
            failures = CounterMetricFamily("kubeinfer_gateway_discovery_failures", "Failed pod lists or watches, "
                                           "by reason: forbidden and unauthorized mean missing RBAC.", labels=["reason"])
            for reason in ("forbidden", "unauthorized", "error"):
                failures.add_metric([reason], discovery.failures.get(reason, 0))
            yield failures
        subscriber = self.metrics.kv_events
        if subscriber is not None:  # --prefix-routing precise
            yield gauge("kubeinfer_gateway_kv_events_pods", "Pods whose KV events the gateway follows.",
                        len(subscriber.index.pods))
            batches = CounterMetricFamily("kubeinfer_gateway_kv_events_batches", "KV-event batches from the engines, "
                                          "by outcome: applied live, replayed after a gap, missed (gone from the "
                                          "engine's replay buffer), undecodable.", labels=["outcome"])
            totals = subscriber.totals()
            for outcome, key in (("applied", "batches"), ("replayed", "replayed"), ("missed", "missed"), ("bad", "bad")):
                batches.add_metric([outcome], totals.get(key, 0))
            yield batches
            dropped = CounterMetricFamily("kubeinfer_gateway_kv_events_pods_dropped", "Pods whose blocks were "
                                          "forgotten: their events connection was down past --kv-events-lost-after.")
            dropped.add_metric([], subscriber.dropped_pods)
            yield dropped
            faults = CounterMetricFamily("kubeinfer_gateway_kv_events_pod_faults", "Times a pod's KV events broke "
                                         "the wire contract or the index's bounds: the pod was forgotten and set "
                                         "aside (scored approximately) for a while.")
            faults.add_metric([], totals.get("faults", 0))
            yield faults
