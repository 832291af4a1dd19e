"""Logging in from inside a pod, and telling whether the API server still answers.

In a pod the API server is KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT, set by the kubelet in every
container, as the official clients (and the gateway, through them) use it. kopf's own service-account login
names https://kubernetes.default.svc, which needs cluster DNS: on a cluster without it every call failed
while the operator looked healthy. The name is the fallback when the variables are missing.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any

import kopf

from kubeinfer.operator.kube import ApiError, KubeClient

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
HOST_ENV, PORT_ENV = "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"
PROBE_TIMEOUT_SECONDS = 5.0


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def in_cluster_server() -> str | None:
    """https://HOST:PORT from the kubelet's variables (an IPv6 address in brackets), or None outside a pod."""
    host, port = os.environ.get(HOST_ENV, "").strip(), os.environ.get(PORT_ENV, "").strip()
    if not host or not port:
        return None
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def login_in_cluster(**_: Any) -> kopf.ConnectionInfo | None:
    """The pod's service account against the API server's Service address; None when not in a pod."""
    token = _read(f"{SERVICE_ACCOUNT_DIR}/token")
    if token is None:
        return None
    ca = f"{SERVICE_ACCOUNT_DIR}/ca.crt"
    return kopf.ConnectionInfo(server=in_cluster_server() or "https://kubernetes.default.svc",
                               ca_path=ca if os.path.exists(ca) else None, token=token,
                               default_namespace=_read(f"{SERVICE_ACCOUNT_DIR}/namespace"))


async def api_server_answers(client: KubeClient, timeout: float = PROBE_TIMEOUT_SECONDS) -> str:
    """For /healthz: what GET /version says, or kopf.PermanentError when the API server does not answer (no
    connection, a timeout, 5xx, credentials refused). An operator that cannot reach it reconciles nothing."""
    try:
        found = await asyncio.wait_for(client.request("GET", "/version"), timeout)
    except ApiError as err:
        if err.status == 401 or err.status >= 500:
            raise kopf.PermanentError(f"the API server refuses the operator: HTTP {err.status}: {err.message}") \
                from None
        return f"answered HTTP {err.status}"  # it is there: /version is not served everywhere
    except Exception as err:  # noqa: BLE001  (any failure to get an answer is the point of the probe)
        raise kopf.PermanentError(f"the API server does not answer: {type(err).__name__}: {err}") from None
    return str((found or {}).get("gitVersion") or "answered")
