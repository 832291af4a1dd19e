"""Assembles the gateway: endpoint pool and discovery, scraper, picker, and its three servers
(HTTP proxy, Envoy ext_proc, Prometheus metrics), started and stopped together."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace

import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kubeinfer.common.http_guard import DEFAULT_HEADER_READ_TIMEOUT, GuardConfig, RequestGuard
from kubeinfer.common.http_server import server_config

from .datastore.discovery import KubernetesDiscovery, static_endpoints
from .datastore.endpoints import EndpointPool
from .datastore.kv_block_index import MAX_BLOCKS_PER_POD, KVBlockIndex
from .datastore.kv_event_subscriber import DEFAULT_EVENTS_PORT, KVEventSubscriber, sources_from_pool
from .datastore.scraper import Scraper
from .flowcontrol.composition import build_flow
from .flowcontrol.fallback import Fallbacks
from .flowcontrol.model_priorities import ClusterPriorities
from .flowcontrol.scale_up import ScaleUp
from .handlers.extproc import start_extproc_server
from .handlers.metrics import GatewayMetrics
from .handlers.proxy import build_proxy_app
from .handlers.routing import Router
from .handlers.upstream import UpstreamConfig
from .scheduling.picker import Picker, PickerConfig
from .scheduling.precise_prefix import PrecisePrefixScorer
from .scheduling.prompt_tokens import Tokenizers

logger = logging.getLogger(__name__)


@dataclass
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int | None = 8080  # HTTP proxy; None: ext_proc only
    ext_proc_port: int | None = 9002
    metrics_port: int | None = 9090
    endpoints: list[str] = field(default_factory=list)  # static endpoints; empty: discover in Kubernetes
    namespace: str | None = None
    selector: dict[str, str] = field(default_factory=dict)
    inference_pool: str | None = None
    target_port: int = 8000
    scrape_interval: float = 0.25
    scrape_timeout: float = 1.0
    picker: PickerConfig = field(default_factory=PickerConfig)
    model_priorities: dict[str, int] = field(default_factory=dict)
    forward_priority: bool = False  # write the engine's `priority` into forwarded bodies
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)  # the proxy's timeouts and retries
    hold_max: int = 256  # requests held per model while it has no ready engine
    hold_timeout: float = 120.0  # seconds a request is held before a 503
    pool_name: str = "default"
    tenants_file: str | None = None  # --tenants: who may call, and each tenant's limits
    trust_tenant_header: bool = False  # x-gateway-tenant names the tenant (a proxy in front authenticated)
    tenant_limit_scope: str = "replica"  # or "divided": each replica enforces 1/gateway_replicas of a limit
    gateway_replicas: int = 1
    usage_log: str | None = None  # JSON lines, one per request
    fallbacks: list[tuple[str, str]] = field(default_factory=list)  # (model, fallback), in order
    fair_queue: bool | None = None  # saturated models' requests wait at the gateway; None: on with tenants
    fair_queue_max_per_tenant: int = 128
    fair_queue_timeout: float = 30.0  # then routed as before, onto a saturated pod
    flow_control: list[dict] | None = None  # --flow-control-config: its checked layers; None: from the flags
    model_resync: float = 60.0  # seconds between re-lists of InferenceModels/Objectives (the watch's safety net)
    engine_api_key: str | None = None  # presented to engines on everything sent to them (engine_auth.py)
    trust_priority_headers: bool = False  # priority/objective headers come from a trusted hop, not clients
    guard: GuardConfig = field(default_factory=lambda: GuardConfig(max_concurrent_requests=8192))  # proxy limits
    header_read_timeout: float = DEFAULT_HEADER_READ_TIMEOUT  # proxy: seconds for a request head
    prefix_routing: str = "approximate"  # or "precise": from the engines' KV events (docs/kv-events.md)
    tokenizers: list[str] = field(default_factory=list)  # --tokenizer [MODEL=]DIR, for precise routing
    kv_events_port: int = DEFAULT_EVENTS_PORT  # engines that do not say where (vLLM's default endpoint)
    kv_events_lost_after: float = 30.0  # seconds a pod's events stream may be down before its blocks go
    kv_events_max_blocks: int = MAX_BLOCKS_PER_POD  # blocks indexed per pod at most


class Gateway:
    def __init__(self, config: GatewayConfig, api_client=None) -> None:
        self.config = config
        self.pool = EndpointPool()
        self.kv_index = self.kv_subscriber = None
        precise = None
        if config.prefix_routing == "precise":
            self.kv_index = KVBlockIndex(config.kv_events_max_blocks)
            precise = PrecisePrefixScorer(self.kv_index, Tokenizers(config.tokenizers))
            self.kv_subscriber = KVEventSubscriber(
                self.kv_index, lambda: sources_from_pool(self.pool, config.kv_events_port),
                lost_after=config.kv_events_lost_after, curve_key=config.engine_api_key)
        self.picker = Picker(self.pool, config.picker, precise=precise)
        self.router = Router(self.picker, GatewayMetrics(self.picker, config.pool_name), config.model_priorities,
                             forward_priority=config.forward_priority)
        self.router.fallbacks = Fallbacks(config.fallbacks)
        self.router.metrics.kv_events = self.kv_subscriber
        self.router.trust_priority_headers = config.trust_priority_headers
        self.scraper = Scraper(self.pool, config.scrape_interval, config.scrape_timeout,
                               engine_api_key=config.engine_api_key)
        self.discovery = self.priorities = self.scale_up = None
        if config.endpoints:
            self.pool.set_members(static_endpoints(config.endpoints))
        else:
            self.discovery = KubernetesDiscovery(self.pool, namespace=config.namespace, selector=config.selector,
                                                 inference_pool=config.inference_pool, target_port=config.target_port,
                                                 api_client=api_client, on_change=self._forget_departed)
            self.router.metrics.discovery = self.discovery
            scale_targets: dict = {}
            self.priorities = ClusterPriorities(self.router.discovered_priorities, self.router.objective_priorities,
                                                namespace=config.namespace, api_client=api_client,
                                                interval=config.model_resync, scale_targets=scale_targets,
                                                fallbacks=self.router.fallbacks.discovered)
            self.scale_up = ScaleUp(scale_targets, api_client)
            self.router.scalable = scale_targets
        # The flow-control layers, from --flow-control-config or the flags (flowcontrol/composition.py).
        self.router.flow_handle.scale_up = self.scale_up
        self.router.flow = build_flow(config, self.router.flow_handle)
        self._tasks: list[asyncio.Task] = []
        self._servers: list[uvicorn.Server] = []
        self._clients: list = []  # upstream HTTP clients to close on stop
        self.extproc = None
        self.ports: dict[str, int] = {}

    def _forget_departed(self) -> None:
        members = set(self.pool.endpoints)
        self.scraper.retain_only(members)
        self.picker.prefix_index.retain_only(members)
        self.router.metrics.retain_endpoints(members)

    async def start(self) -> None:
        if self.discovery is not None:
            self.discovery.start(asyncio.get_running_loop())
            self.priorities.api_client = self.scale_up.api_client = self.discovery.api_client
            self.priorities.start(asyncio.get_running_loop())
        await self.scraper.scrape_all()  # route on real numbers from the first request on
        self._tasks.append(asyncio.create_task(self.scraper.run()))
        if self.kv_subscriber is not None:
            self.kv_subscriber.start()  # its own thread: events never wait on the request path
        cfg = self.config
        if cfg.ext_proc_port is not None:
            self.extproc = await start_extproc_server(self.router, cfg.host, cfg.ext_proc_port,
                                                      engine_api_key=cfg.engine_api_key,
                                                      max_body_bytes=cfg.guard.max_body_bytes)
            self.ports["ext_proc"] = self.extproc.port
        if cfg.port is not None:
            upstream = replace(cfg.upstream, engine_api_key=cfg.engine_api_key or cfg.upstream.engine_api_key)
            proxy = build_proxy_app(self.router, upstream=upstream)
            proxy.add_middleware(RequestGuard, config=cfg.guard)  # body size and time, requests in flight
            self._clients.append(proxy.state.client)
            await self._serve_http("proxy", proxy, cfg.port, cfg.header_read_timeout)
        if cfg.metrics_port is not None:
            await self._serve_http("metrics", self._metrics_app(), cfg.metrics_port)

    def _metrics_app(self) -> FastAPI:
        app = FastAPI(openapi_url=None)

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.router.metrics.registry), media_type=CONTENT_TYPE_LATEST)
        return app

    async def _serve_http(self, name: str, app, port: int,
                          header_read_timeout: float = DEFAULT_HEADER_READ_TIMEOUT) -> None:
        server = uvicorn.Server(server_config(app, header_read_timeout, host=self.config.host, port=port,
                                              log_level="warning", lifespan="off"))
        server.install_signal_handlers = lambda: None  # the CLI owns signals
        self._tasks.append(asyncio.create_task(server.serve()))
        while not server.started:
            if self._tasks[-1].done():  # failed to bind: surface the error
                self._tasks[-1].result()
            await asyncio.sleep(0.01)
        self.ports[name] = server.servers[0].sockets[0].getsockname()[1]
        self._servers.append(server)

    async def stop(self) -> None:
        for server in self._servers:
            server.should_exit = True
        if self.extproc is not None:
            await self.extproc.stop(1)
        if self.discovery is not None:
            self.discovery.stop()
            self.priorities.stop()
        scrape, *servers = self._tasks
        scrape.cancel()
        if servers:
            await asyncio.wait(servers, timeout=5)
        for task in self._tasks:
            task.cancel()
        await self.scraper.close()
        if self.kv_subscriber is not None:
            await asyncio.to_thread(self.kv_subscriber.stop)
        for client in self._clients:
            await client.aclose()
        self.router.flow.close()
