"""Where the endpoints come from: a static list, or engine pods watched in Kubernetes.

In Kubernetes the gateway lists and then watches pods (re-listing after any watch error), selected by an
`InferencePool` (`inference.networking.k8s.io/v1`: its `selector.matchLabels` and `targetPorts`) or by a
label selector. Only pods that are Running, Ready, not terminating and, when they carry a role label,
`active` are endpoints; warm standby pods stay out until the operator promotes them. Each pod's
adapter placement comes from its `serving.kubeinfer.io/adapters` annotation. Labels are matched here
too, not only by the API server, so a server that ignores `labelSelector` cannot leak pods in.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from urllib.parse import urlparse

from .endpoints import ADAPTERS_ANNOTATION, Endpoint, EndpointPool

logger = logging.getLogger(__name__)
ROLE_LABEL = "serving.kubeinfer.io/role"
POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"


def parse_address(url: str) -> str:
    """'http://10.0.0.5:8000', '10.0.0.5:8000' or 'localhost:8000' -> 'host:port'."""
    parsed = urlparse(url if "//" in url else f"http://{url}")
    if not parsed.hostname or not parsed.port:
        raise ValueError(f"endpoint {url!r} needs a host and a port, e.g. http://10.0.0.5:8000")
    host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
    return f"{host}:{parsed.port}"


def static_endpoints(urls: list[str]) -> list[Endpoint]:
    return [Endpoint(address=parse_address(url), name=url) for url in urls if url.strip()]


def parse_selector(text: str) -> dict[str, str]:
    """'a=b,c=d' -> {'a': 'b', 'c': 'd'} (equality selectors only)."""
    selector = {}
    for term in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = term.partition("=")
        if not sep or not key:
            raise ValueError(f"selector term {term!r} must be KEY=VALUE")
        selector[key.strip()] = value.strip().lstrip("=")
    return selector


def endpoint_of(pod: dict, selector: dict[str, str], port: int) -> Endpoint | None:
    """The pod as an endpoint, or None if it must not receive traffic now."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    labels = meta.get("labels") or {}
    if any(labels.get(k) != v for k, v in selector.items()):
        return None
    if labels.get(ROLE_LABEL, "active") != "active" or meta.get("deletionTimestamp"):
        return None
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    ip = status.get("podIP")
    if status.get("phase") != "Running" or not ready or not ip:
        return None
    adapters = (meta.get("annotations") or {}).get(ADAPTERS_ANNOTATION, "")
    host = f"[{ip}]" if ":" in ip else ip
    return Endpoint(address=f"{host}:{port}", name=meta.get("name", ""),
                    placed_adapters=frozenset(a.strip() for a in adapters.split(",") if a.strip()))


def pool_selector(pool: dict) -> tuple[dict[str, str], int | None]:
    """(matchLabels, target port) of an InferencePool; v1 shape, with v1alpha2's flat selector accepted."""
    spec = pool.get("spec") or {}
    selector = spec.get("selector") or {}
    labels = selector.get("matchLabels", selector) if isinstance(selector, dict) else {}
    ports = spec.get("targetPorts") or []
    port = ports[0].get("number") if ports else spec.get("targetPortNumber")
    return dict(labels), port


class KubernetesDiscovery:
    """Watches pods on a thread (the kubernetes client is synchronous) and publishes membership to the pool
    on the event loop."""

    def __init__(self, pool: EndpointPool, *, namespace: str | None, selector: dict[str, str] | None = None,
                 inference_pool: str | None = None, target_port: int = 8000, api_client=None,
                 on_change: Callable[[], None] | None = None, watch_timeout: float = 60.0) -> None:
        if not selector and not inference_pool:
            raise ValueError("Kubernetes discovery needs --selector or --inference-pool")
        if inference_pool and not namespace:
            raise ValueError("--inference-pool needs --namespace (InferencePools are namespaced)")
        self.pool, self.namespace, self.selector = pool, namespace, dict(selector or {})
        self.inference_pool, self.target_port = inference_pool, target_port
        self.api_client = api_client
        self.on_change = on_change
        self.watch_timeout = watch_timeout  # a quiet watch is re-opened after this long (and stop() takes effect)
        self._stop = threading.Event()
        self._pods: dict[str, dict] = {}
        self.failures: dict[str, int] = {}  # failed lists/watches by reason (forbidden, unauthorized, error)
        self.last_error: str | None = None  # cleared by the next successful list

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        if self.api_client is None:
            self.api_client = _default_api_client()
        threading.Thread(target=self._run, name="pod-discovery", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _publish(self) -> None:
        members = [e for e in (endpoint_of(p, self.selector, self.target_port) for p in self._pods.values()) if e]
        members.sort(key=lambda e: e.address)

        def apply() -> None:
            self.pool.set_members(members)
            if self.on_change:
                self.on_change()
        self.loop.call_soon_threadsafe(apply)

    def _resolve_pool(self, custom) -> None:
        pool = custom.get_namespaced_custom_object(POOL_GROUP, POOL_VERSION, self.namespace, POOL_PLURAL,
                                                   self.inference_pool)
        selector, port = pool_selector(pool)
        self.selector, self.target_port = {**selector, **self.selector}, port or self.target_port

    def _run(self) -> None:
        from kubernetes import client, watch

        core, custom = client.CoreV1Api(self.api_client), client.CustomObjectsApi(self.api_client)
        label_selector = None
        while not self._stop.is_set():
            try:
                if self.inference_pool:
                    self._resolve_pool(custom)
                label_selector = ",".join(f"{k}={v}" for k, v in self.selector.items()) or None
                listing = self._list(core, label_selector)
                self._pods = {p["metadata"]["name"]: p for p in listing.get("items", [])}
                if self.last_error is not None:
                    logger.info("pod discovery works again: %d pods", len(self._pods))
                self.last_error = None
                self._publish()
                stream = watch.Watch().stream(self._lister(core), label_selector=label_selector,
                                              timeout_seconds=max(1, int(self.watch_timeout)),
                                              _request_timeout=self.watch_timeout + 1,
                                              resource_version=(listing.get("metadata") or {}).get("resourceVersion"))
                for event in stream:
                    if self._stop.is_set():
                        return
                    pod = self.api_client.sanitize_for_serialization(event["object"])
                    name = (pod.get("metadata") or {}).get("name")
                    if event["type"] == "DELETED":
                        self._pods.pop(name, None)
                    elif name:
                        self._pods[name] = pod
                    self._publish()
            except Exception as error:  # API server hiccup, expired watch: list again shortly
                self._stop.wait(self._failed(error))

    def _failed(self, error: Exception) -> float:
        """Records a failed list or watch; one log line per new cause (never a traceback a second); the
        seconds to wait before listing again. A refusal (401/403) is a configuration error: it waits longer."""
        status = getattr(error, "status", None)
        reason = {401: "unauthorized", 403: "forbidden"}.get(status, "error")
        self.failures[reason] = self.failures.get(reason, 0) + 1
        where = f"namespace {self.namespace}" if self.namespace else "all namespaces"
        message = (f"pod discovery is {reason}: the gateway's ServiceAccount may not list pods in {where} "
                   "(grant get/list/watch on pods there, e.g. the chart's gateway.watchAllNamespaces, or put the "
                   "models in the gateway's namespace)" if reason != "error" else f"pod discovery: {error}")
        if message != self.last_error:
            (logger.error if reason != "error" else logger.warning)("%s; retrying", message.splitlines()[0])
        self.last_error = message
        return 10.0 if reason != "error" else 1.0

    def _lister(self, core):
        if self.namespace:
            return lambda **kw: core.list_namespaced_pod(self.namespace, **kw)
        return core.list_pod_for_all_namespaces

    def _list(self, core, label_selector: str | None) -> dict:
        response = self._lister(core)(label_selector=label_selector)
        return self.api_client.sanitize_for_serialization(response)


def _default_api_client():
    """In-cluster credentials when running in a pod, else KUBECONFIG / ~/.kube/config."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()
