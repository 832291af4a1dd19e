"""Where each engine pod publishes its KV events: read from its `/load` report, checked before any socket opens.

An engine's report (or whatever answers at its address) names the addresses the gateway connects to, so
each is checked: `tcp://HOST:PORT` on the pod's own host (its IP, or one its name resolves to: a report
cannot send the gateway to another host, a local `ipc://` path or any other transport), a port in range, a
topic that is a short string, and an `auth` the gateway knows (`null`, or `"curve"`:
kubeinfer/common/kv_events_curve.py). A report that fails is logged once per pod and reason, and the pod is not
followed: its prefixes are scored approximately. vLLM (read from
Prometheus text, no report) is followed at `tcp://POD_HOST:--kv-events-port`, without CURVE.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import time
from dataclasses import dataclass

from kubeinfer.common.kv_events_curve import AUTH_CURVE

logger = logging.getLogger(__name__)

DEFAULT_EVENTS_PORT = 5557  # vLLM's default `endpoint` (tcp://*:5557)
MAX_TOPIC_CHARS = 256
MAX_ENDPOINT_CHARS = 300
_WARNED_LIMIT = 10_000  # (pod, reason) pairs remembered so that each is logged once
NAME_TTL_S = 30.0  # a static endpoint given by name: its addresses, looked up again after this


class SourceError(ValueError):
    """A `kv_events` report the gateway will not follow."""


@dataclass(frozen=True)
class EventSource:
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    auth: str | None = None  # "curve": the engine's sockets are CURVE servers keyed from the engine API key


def source_from_report(pod: str, report: dict) -> EventSource:
    """The checked source of one pod (`HOST:PORT`) from its report's `kv_events`; SourceError naming the field."""
    if not isinstance(report, dict):
        raise SourceError(f"kv_events is a {type(report).__name__}, not an object")
    host = _host(pod)
    endpoint = _endpoint(report.get("endpoint"), host, "endpoint")
    replay = report.get("replay_endpoint")
    replay = None if replay is None else _endpoint(replay, host, "replay_endpoint")
    topic = report.get("topic")
    topic = "" if topic is None else topic
    if not isinstance(topic, str) or len(topic) > MAX_TOPIC_CHARS:
        raise SourceError(f"kv_events.topic must be a string of at most {MAX_TOPIC_CHARS} characters")
    auth = report.get("auth")
    if auth not in (None, AUTH_CURVE):
        raise SourceError(f"kv_events.auth {str(auth)[:40]!r} is not one this gateway knows (null, {AUTH_CURVE!r})")
    return EventSource(endpoint, replay, topic, auth)


def sources_from_pool(pool, events_port: int = DEFAULT_EVENTS_PORT) -> dict[str, EventSource]:
    """Each scraped endpoint's events source: what its /load report names, else (Prometheus text: vLLM)
    the pod's host at `events_port`. Reports that fail the checks are left out (logged once)."""
    sources = {}
    for endpoint in list(pool):
        state = endpoint.state
        if state is None:
            continue
        if state.load_report:
            report = state.kv_events
            if report:
                try:
                    sources[endpoint.address] = source_from_report(endpoint.address, report)
                except SourceError as error:
                    _warn_once(endpoint.address, str(error))
        elif events_port:
            host = endpoint.address.rsplit(":", 1)[0]
            sources[endpoint.address] = EventSource(f"tcp://{host}:{events_port}")
    return sources


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]").lower()


def _endpoint(value, pod_host: str, name: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_ENDPOINT_CHARS or not value.startswith("tcp://"):
        raise SourceError(f"kv_events.{name} must be a tcp:// address")
    host, sep, port = value[len("tcp://"):].rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise SourceError(f"kv_events.{name} {value[:80]!r} has no port in 1-65535")
    if not _same_host(host.strip("[]").lower(), pod_host):
        raise SourceError(f"kv_events.{name} {value[:80]!r} is not on the pod's own host {pod_host}")
    return value


def _same_host(host: str, pod_host: str) -> bool:
    if host == pod_host or (_loopback(host) and _loopback(pod_host)):
        return True
    return not _is_ip(pod_host) and host in _addresses_of(pod_host)  # --endpoints by name; engines say an IP


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


_names: dict[str, tuple[float, frozenset[str]]] = {}


def _addresses_of(name: str) -> frozenset[str]:
    now = time.monotonic()
    cached = _names.get(name)
    if cached is not None and cached[0] > now:
        return cached[1]
    try:
        found = frozenset(info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP))
    except OSError:
        found = frozenset()
    if len(_names) >= _WARNED_LIMIT:
        _names.clear()
    _names[name] = (now + NAME_TTL_S, found)
    return found


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_warned: set[tuple[str, str]] = set()


def _warn_once(pod: str, reason: str) -> None:
    if (pod, reason) in _warned:
        return
    if len(_warned) >= _WARNED_LIMIT:
        _warned.clear()
    _warned.add((pod, reason))
    logger.warning("KV events: not following %s: its /load report's %s; its prefixes are scored approximately",
                   pod, reason)
