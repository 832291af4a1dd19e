"""`kubeinfer gateway`: the endpoint picker as Envoy ext_proc server and as a standalone HTTP proxy."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from kubeinfer.common.engine_key import gateway_key_from_env
from kubeinfer.common.http_guard import add_http_limit_arguments, guard_from_args

from .datastore.discovery import parse_selector
from .datastore.kv_block_index import MAX_BLOCKS_PER_POD
from .flowcontrol.composition import read_flow_config
from .flowcontrol.fallback import parse_fallback
from .flowcontrol.tenant_limits import SCOPES
from .flowcontrol.tenants import load_tenants
from .scheduling.picker import DEFAULT_WEIGHTS, POLICIES, PickerConfig
from .scheduling.profiles import read_config
from .scheduling.prompt_tokens import Tokenizers


def _weights(text: str) -> dict[str, float]:
    weights = dict(DEFAULT_WEIGHTS)
    for key, value in parse_selector(text).items():
        try:
            weights[key] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"scorer weight {key}={value!r} is not a number") from None
    return weights


def _priority(text: str) -> tuple[str, int]:
    name, sep, value = text.rpartition("=")
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--model-priority takes NAME=INT, got {text!r}") from None


def _fallback(text: str) -> tuple[str, str]:
    try:
        return parse_fallback(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080, help="OpenAI-compatible HTTP proxy (0: off)")
    parser.add_argument("--ext-proc-port", type=int, default=9002, help="Envoy ext_proc gRPC server (0: off)")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics (0: off)")
    parser.add_argument("--endpoints", default="", help="static engine URLs, comma-separated (no Kubernetes)")
    parser.add_argument("--namespace", default=None, help="watch engine pods in this namespace (default: all)")
    parser.add_argument("--selector", default="", help="engine pod label selector KEY=VALUE,...")
    parser.add_argument("--inference-pool", default=None, help="InferencePool whose selector and port to use")
    parser.add_argument("--pool-name", default=None, help="'name' label of the inference_pool_* metrics")
    parser.add_argument("--target-port", type=int, default=8000, help="engine HTTP port on discovered pods")
    parser.add_argument("--scrape-interval", type=float, default=0.25, help="seconds between engine scrapes")
    parser.add_argument("--scrape-timeout", type=float, default=1.0)
    parser.add_argument("--stale-after", type=float, default=5.0, help="seconds before a scrape is not trusted")
    parser.add_argument("--queue-threshold", type=float, default=5.0, help="waiting requests that saturate a pod")
    parser.add_argument("--kv-threshold", type=float, default=0.8, help="KV-cache usage that saturates a pod")
    parser.add_argument("--routing", choices=POLICIES, default="scored",
                        help="scored: the endpoint picker; round-robin: rotate over the pods serving the model "
                             "(a baseline for comparisons)")
    parser.add_argument("--scorer-weights", type=_weights, default=dict(DEFAULT_WEIGHTS),
                        help="e.g. queue=2,active=1,kv_cache=1,lora=2,prefix=4,affinity=1")
    parser.add_argument("--scheduler-config", metavar="FILE",
                        help="an EndpointPickerConfig (YAML): plugins and scheduling profiles in place of "
                             "--scorer-weights and --routing (docs/gateway-plugins.md)")
    parser.add_argument("--prefix-routing", choices=("approximate", "precise"), default="approximate",
                        help="approximate: where this gateway sent each prompt's chunks; precise: which KV blocks each "
                             "engine holds, from its KV events (engines run with --kv-events-config; needs "
                             "--tokenizer). Pods without events are scored approximately (docs/kv-events.md)")
    parser.add_argument("--tokenizer", action="append", default=[], metavar="[MODEL=]DIR",
                        help="the model's tokenizer files (tokenizer.json, tokenizer_config.json, chat template) for "
                             "precise prefix routing; MODEL= for one model, else the default (repeatable)")
    parser.add_argument("--kv-events-port", type=int, default=5557,
                        help="KV-events port of engines whose load report does not name their events endpoint "
                             "(vLLM: its --kv-events-config endpoint); 0: subscribe only where engines say")
    parser.add_argument("--kv-events-lost-after", type=float, default=30.0,
                        help="seconds a pod's KV-events connection may stay down before its blocks are forgotten")
    parser.add_argument("--kv-events-max-blocks", type=int, default=MAX_BLOCKS_PER_POD,
                        help="KV blocks indexed per pod at most (all media); further ones are not indexed")
    parser.add_argument("--model-priority", type=_priority, action="append", default=[], metavar="NAME=INT",
                        help="routing priority of a model; below 0 its requests are sheddable")
    parser.add_argument("--hold-max", type=int, default=256,
                        help="requests held per model while it has no ready engine (scaled to zero, starting); "
                             "beyond it, 503 with Retry-After")
    parser.add_argument("--hold-timeout", type=float, default=120.0,
                        help="seconds a held request waits for an engine before a 503 with Retry-After")
    parser.add_argument("--forward-priority", action="store_true",
                        help="write each request's priority into the body for the engine (inverted: the engine's lower "
                             "runs first); the engines must run --scheduling-policy priority, as the operator's do")
    parser.add_argument("--upstream-connect-timeout", type=float, default=10.0,
                        help="seconds to connect to an engine before trying another")
    parser.add_argument("--upstream-first-byte-timeout", type=float, default=600.0,
                        help="seconds an engine may hold a request before its response begins (queueing included)")
    parser.add_argument("--upstream-idle-timeout", type=float, default=300.0,
                        help="longest gap in seconds between two chunks of an engine's response")
    parser.add_argument("--upstream-max-attempts", type=int, default=3,
                        help="endpoints a request may try when one fails or refuses before answering")
    parser.add_argument("--tenants", default=None, metavar="FILE",
                        help="tenants YAML (API keys and limits per tenant; re-read when it changes); without it "
                             "every caller is admitted")
    parser.add_argument("--trust-tenant-header", action="store_true",
                        help="take the tenant from the x-gateway-tenant header (set by an authenticating proxy "
                             "in front) before the Authorization key")
    parser.add_argument("--tenant-limit-scope", choices=SCOPES, default="replica",
                        help="replica: each gateway replica enforces the full limits (N replicas admit up to N "
                             "times them); divided: each enforces 1/--gateway-replicas of every limit")
    parser.add_argument("--gateway-replicas", type=int, default=1, help="replicas sharing the tenant limits "
                        "(with --tenant-limit-scope divided)")
    parser.add_argument("--usage-log", default=None, metavar="FILE", help="append one JSON line per request "
                        "(tenant, model, status, prompt/cached/completion tokens, seconds) for chargeback")
    parser.add_argument("--fallback", type=_fallback, action="append", default=[], metavar="MODEL=OTHER",
                        help="serve MODEL's requests with OTHER when MODEL has no ready pod, all its pods are "
                             "saturated, or (proxy) all failed before answering; repeat for more, in order")
    parser.add_argument("--fair-queue", action=argparse.BooleanOptionalAction, default=None,
                        help="when every pod of a model is saturated, hold its requests at the gateway and dispatch "
                             "them by weighted fair share across tenants, priority first within one (default: on "
                             "with --tenants)")
    parser.add_argument("--fair-queue-max-per-tenant", type=int, default=128,
                        help="requests of one tenant that may wait in the fair queue; beyond, 429 with Retry-After")
    parser.add_argument("--flow-control-config", metavar="FILE",
                        help="a FlowControlConfig (YAML): the flow-control layers a request passes, in order, each "
                             "parameter defaulting to its flag; default: tenants, tokenize, fallback, hold, "
                             "fair-queue as the flags enable them (docs/gateway-plugins.md)")
    parser.add_argument("--fair-queue-timeout", type=float, default=30.0,
                        help="seconds a request waits in the fair queue before it is routed to a saturated pod anyway")
    parser.add_argument("--model-resync", type=float, default=60.0, metavar="SECONDS",
                        help="InferenceModels and InferenceObjectives are watched (changes count at once); they are "
                             "also listed again this often, a safety net for events a watch missed")
    parser.add_argument("--engine-api-key", default=gateway_key_from_env(),
                        help="key presented to engines as 'Authorization: Bearer KEY' on everything sent to them, in "
                             "place of the client's (env KUBEINFER_ENGINE_API_KEY; the engines' --api-key)")
    parser.add_argument("--trust-priority-headers", action="store_true",
                        help="take x-gateway-inference-priority / x-gateway-inference-objective from requests (a "
                             "trusted proxy in front sets them); off: clients cannot set their own priority")
    add_http_limit_arguments(parser, max_concurrent_requests=8192)
    parser.add_argument("--log-level", default="info")


def config_from_args(args: argparse.Namespace):
    from .app import GatewayConfig  # the servers' imports (grpc, Envoy protos, uvicorn) only when used
    from .handlers.upstream import UpstreamConfig

    endpoints = [e for e in args.endpoints.split(",") if e.strip()]
    if not endpoints and not (args.selector or args.inference_pool):
        raise SystemExit("kubeinfer gateway: give --endpoints, or --selector / --inference-pool to discover pods")
    try:
        picker = PickerConfig(weights=args.scorer_weights, queue_threshold=args.queue_threshold,
                              kv_threshold=args.kv_threshold, stale_after=args.stale_after,
                              policy=args.routing,
                              scheduler=read_config(args.scheduler_config) if args.scheduler_config else None)
        selector = parse_selector(args.selector)
        if args.prefix_routing == "precise":
            if not args.tokenizer:
                raise ValueError("--prefix-routing precise needs the model's tokenizer: --tokenizer [MODEL=]DIR")
            Tokenizers(args.tokenizer)  # an unreadable tokenizer stops the start with its reason
        flow_control = read_flow_config(args.flow_control_config) if args.flow_control_config else None
        if args.tenants:
            load_tenants(args.tenants)  # a broken file stops the start with its reason (TenantFileError)
    except ValueError as error:
        raise SystemExit(f"kubeinfer gateway: {error}") from None
    return GatewayConfig(host=args.host, port=args.port or None, ext_proc_port=args.ext_proc_port or None,
                         metrics_port=args.metrics_port or None, endpoints=endpoints, namespace=args.namespace,
                         selector=selector, inference_pool=args.inference_pool, target_port=args.target_port,
                         scrape_interval=args.scrape_interval, scrape_timeout=args.scrape_timeout, picker=picker,
                         model_priorities=dict(args.model_priority), forward_priority=args.forward_priority,
                         hold_max=args.hold_max, hold_timeout=args.hold_timeout,
                         pool_name=args.pool_name or args.inference_pool or "default",
                         tenants_file=args.tenants, trust_tenant_header=args.trust_tenant_header,
                         tenant_limit_scope=args.tenant_limit_scope, gateway_replicas=max(1, args.gateway_replicas),
                         usage_log=args.usage_log, fallbacks=list(args.fallback), fair_queue=args.fair_queue,
                         fair_queue_max_per_tenant=max(1, args.fair_queue_max_per_tenant),
                         fair_queue_timeout=args.fair_queue_timeout, flow_control=flow_control,
                         model_resync=max(1.0, args.model_resync),
                         engine_api_key=args.engine_api_key,
                         trust_priority_headers=args.trust_priority_headers, guard=guard_from_args(args),
                         header_read_timeout=args.header_read_timeout, prefix_routing=args.prefix_routing,
                         tokenizers=list(args.tokenizer), kv_events_port=args.kv_events_port,
                         kv_events_lost_after=args.kv_events_lost_after,
                         kv_events_max_blocks=max(1, args.kv_events_max_blocks),
                         upstream=UpstreamConfig(connect_timeout=args.upstream_connect_timeout,
                                                 first_byte_timeout=args.upstream_first_byte_timeout,
                                                 idle_timeout=args.upstream_idle_timeout,
                                                 max_attempts=max(1, args.upstream_max_attempts)))


async def _serve(config) -> int:
    from .app import Gateway

    gateway = Gateway(config)
    await gateway.start()
    logging.getLogger("kubeinfer.gateway").info("gateway serving on %s", gateway.ports)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await gateway.stop()
    return 0


def raise_open_files_limit() -> None:
    """Each proxied stream holds two sockets (client and engine): the default soft limit (often 1024)
    would refuse connections in a burst of a few hundred streams; the hard limit is ours to take."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # a container may cap it lower: keep what we have
            pass


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per scrape and per request: CPU on the loop
    raise_open_files_limit()
    return asyncio.run(_serve(config_from_args(args)))
