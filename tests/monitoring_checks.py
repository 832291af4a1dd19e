"""PromQL checks for the dashboard and the alert rules, on the AST of a real PromQL parser.

- Which metric names a query reads (`metric_names`), checked against what the engine and gateway export.
- Counters and histogram buckets are only read through rate()/increase()/irate() (`unrated_counters`):
  a raw counter on a graph is a line that only goes up.
- Which labels a query's result keeps (`output_labels`), so an alert annotation that prints
  `{{ $labels.pod }}` after `sum by (model_name)` is caught.
"""
from __future__ import annotations

import re

import promql_parser

# DESIGN.md, "Engine metrics": vLLM's names, every series labelled model_name.
ENGINE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info", "vllm:lora_requests_info")
ENGINE_COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions",
                   "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
ENGINE_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                     "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                     "vllm:request_prompt_tokens", "vllm:request_generation_tokens")

# Grafana's macros are not PromQL; give them a value of the same kind before parsing.
GRAFANA_MACROS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
RATE_FUNCTIONS = {"rate", "irate", "increase"}


def wire_names(gauges=(), counters=(), histograms=()) -> dict[str, str]:
    """Series name on the wire -> 'gauge' | 'counter' | 'histogram'."""
    names = {name: "gauge" for name in gauges}
    names.update({f"{name}_total": "counter" for name in counters})
    for name in histograms:
        names[f"{name}_bucket"] = "histogram"
        names.update({f"{name}_sum": "counter", f"{name}_count": "counter"})
    return names


def engine_names() -> dict[str, str]:
    return wire_names(ENGINE_GAUGES, ENGINE_COUNTERS, ENGINE_HISTOGRAMS)


def gateway_names() -> dict[str, str]:
    """What the gateway's registry exports (its families, before any request creates a sample)."""
    from kubeinfer.gateway.handlers.metrics import GatewayMetrics

    class NoEndpoints:
        def ready_endpoints(self) -> list:
            return []

    families = list(GatewayMetrics(NoEndpoints()).registry.collect())
    kinds: dict[str, tuple[str, ...]] = {"gauge": (), "counter": (), "histogram": ()}
    for family in families:
        kinds[family.type] = kinds.get(family.type, ()) + (family.name,)
    return wire_names(kinds["gauge"], kinds["counter"], kinds["histogram"])


def parse(expr: str):
    for macro, value in GRAFANA_MACROS.items():
        expr = expr.replace(macro, value)
    return promql_parser.parse(expr)


def selectors(expr: str) -> list:
    found = []

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)

    promql_parser.walk(parse(expr), visit)
    return found


def metric_names(expr: str) -> set[str]:
    return {selector.name for selector in selectors(expr)}


def matchers(selector) -> dict[str, str]:
    return {m.name: m.value for m in selector.matchers.matchers}


def unrated_counters(expr: str, kinds: dict[str, str]) -> list[str]:
    """Counter or bucket series read outside rate()/increase()/irate()."""
    bad: list[str] = []
    _find_unrated(parse(expr), kinds, False, bad)
    return bad


def _find_unrated(node, kinds: dict[str, str], rated: bool, bad: list[str]) -> None:
    if isinstance(node, promql_parser.VectorSelector):
        if not rated and kinds.get(node.name) in ("counter", "histogram"):
            bad.append(node.name)
        return
    if isinstance(node, promql_parser.Call):
        for arg in node.args:
            _find_unrated(arg, kinds, node.func.name in RATE_FUNCTIONS, bad)
        return
    for child in _children(node):
        _find_unrated(child, kinds, rated, bad)


def _children(node) -> list:
    if isinstance(node, promql_parser.MatrixSelector):
        return [node.vector_selector]
    if isinstance(node, promql_parser.BinaryExpr):
        return [node.lhs, node.rhs]
    if isinstance(node, promql_parser.AggregateExpr):
        return [node.expr] + ([node.param] if node.param is not None else [])
    if isinstance(node, (promql_parser.ParenExpr, promql_parser.SubqueryExpr, promql_parser.UnaryExpr)):
        return [node.expr]
    if isinstance(node, promql_parser.Call):
        return list(node.args)
    return []


def output_labels(expr: str) -> set[str] | None:
    """Labels every result series is known to carry at most; None when any label may survive."""
    return _labels(parse(expr))


_KEEP_ALL_AGGREGATIONS = {"topk", "bottomk", "limitk", "limit_ratio"}
_SET_OPERATORS = {"and", "unless"}


def _labels(node) -> set[str] | None:
    if isinstance(node, (promql_parser.VectorSelector, promql_parser.MatrixSelector)):
        return None
    if isinstance(node, (promql_parser.NumberLiteral, promql_parser.StringLiteral)):
        return set()
    if isinstance(node, (promql_parser.ParenExpr, promql_parser.SubqueryExpr, promql_parser.UnaryExpr)):
        return _labels(node.expr)
    if isinstance(node, promql_parser.AggregateExpr):
        if str(node.op) in _KEEP_ALL_AGGREGATIONS:
            return _labels(node.expr)
        modifier = node.modifier
        if modifier is None:
            return set()
        if modifier.type == promql_parser.AggModifierType.By:
            return set(modifier.labels)
        return None  # `without` keeps whatever else the input had
    if isinstance(node, promql_parser.Call):
        literals = (promql_parser.NumberLiteral, promql_parser.StringLiteral)
        vectors = [arg for arg in node.args if not isinstance(arg, literals)]
        if node.func.name.startswith("label_") or not vectors:
            return None if vectors else set()
        inner = _labels(vectors[0])
        if node.func.name == "histogram_quantile" and inner is not None:
            inner = inner - {"le"}
        return inner
    if isinstance(node, promql_parser.BinaryExpr):
        left, right = _labels(node.lhs), _labels(node.rhs)
        op = str(node.op)
        if op in _SET_OPERATORS:
            return left
        if op == "or":
            return None if left is None or right is None else left | right
        if _is_scalar(node.lhs):
            return right
        card = str(node.modifier.card) if node.modifier is not None else ""
        if "ManyToOne" in card or "OneToMany" in card:
            return None  # group_left / group_right copy labels across: not tracked here
        return left
    return None


def _is_scalar(node) -> bool:
    return isinstance(node, promql_parser.NumberLiteral) or (
        isinstance(node, promql_parser.ParenExpr) and _is_scalar(node.expr))


TEMPLATE_LABEL = re.compile(r"\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)")


def template_labels(text: str) -> set[str]:
    """Labels an alert annotation prints through {{ $labels.X }}."""
    return set(TEMPLATE_LABEL.findall(text))
