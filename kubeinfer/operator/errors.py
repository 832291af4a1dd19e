"""What a failed API call means for the model, and so what the operator does about it.

403 is a missing permission: retrying cannot help until an admin grants it, so the model is
Degraded with reason Forbidden, naming the verb and resource to grant. 400 and 422 are the API
server refusing an object built from the spec (admission, validation): InvalidSpec with the
server's own message. Everything else (409 conflicts, 404 on an object that just went away, 429,
5xx, timeouts, broken connections) is expected to pass: retried with backoff while Progressing.
A 403 for a namespace being deleted is no missing permission: the namespace refuses new objects while its
contents go, the model with them, so the operator says so once (NamespaceTerminating) and stops.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import aiohttp

from kubeinfer.operator.kube import ApiError

FORBIDDEN = "Forbidden"
INVALID = "InvalidSpec"
RETRYING = "Retrying"
TERMINATING = "NamespaceTerminating"
# The API server's words when a namespace refuses new content (its Status names the cause too)
TERMINATING_MESSAGE = "because it is being terminated"
INVALID_STATUSES = (400, 422)
BACKOFF_BASE = 0.5
BACKOFF_MAX = 30.0

_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


@dataclass(frozen=True)
class Request:
    """An API call as RBAC sees it: verb, resource (with subresource), group and namespace."""
    verb: str
    resource: str
    group: str = ""
    namespace: str | None = None

    def __str__(self) -> str:
        where = f" in namespace {self.namespace}" if self.namespace else " cluster-wide"
        group = f" (API group {self.group!r})" if self.group else ""
        return f"{self.verb} {self.resource}{group}{where}"


def rbac_request(method: str, path: str) -> Request:
    """/apis/GROUP/VERSION/namespaces/NS/PLURAL/NAME/SUB (or /api/v1/...) -> RBAC verb and resource."""
    parts = [unquote(p) for p in urlsplit(path).path.strip("/").split("/")]
    group, rest = ("", parts[2:]) if parts[:1] == ["api"] else (parts[1] if len(parts) > 1 else "", parts[3:])
    namespace = None
    if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) != 2:
        namespace, rest = rest[1], rest[2:]
    plural = rest[0] if rest else ""
    named = len(rest) >= 2
    resource = f"{plural}/{rest[2]}" if len(rest) >= 3 else plural
    verb = _VERBS.get(method.upper(), "get" if named else "list")
    return Request(verb, resource, group, namespace)


@dataclass(frozen=True)
class Failure:
    reason: str  # Forbidden, InvalidSpec, NamespaceTerminating or Retrying
    message: str

    @property
    def retry(self) -> bool:
        return self.reason == RETRYING

    @property
    def log_level(self) -> int:
        """How loud the first report is: a namespace going away is expected, a refusal is not."""
        return {RETRYING: logging.WARNING, TERMINATING: logging.INFO}.get(self.reason, logging.ERROR)


def classify(err: BaseException) -> Failure | None:
    """A Failure for errors from talking to the API server; None for anything else (a bug: re-raise)."""
    if isinstance(err, ApiError):
        request = rbac_request(err.method, err.path)
        if err.status == 403 and (TERMINATING in err.causes or TERMINATING_MESSAGE in err.message):
            return Failure(TERMINATING, f"namespace {request.namespace or '(cluster)'} is being deleted: it refuses "
                                        f"new objects ({request}), and the model goes with it; nothing more is "
                                        "built there")
        if err.status == 403:
            return Failure(FORBIDDEN, f"the operator is not allowed to {request}: {err.message}; grant it in the "
                                      "operator's ClusterRole or Role (the chart's RBAC does)")
        if err.status in INVALID_STATUSES:
            return Failure(INVALID, f"the API server refused to {request}: {err.message}")
        return Failure(RETRYING, f"{request} failed with HTTP {err.status}: {err.message}; retrying")
    if isinstance(err, (aiohttp.ClientError, TimeoutError, ConnectionError)):
        return Failure(RETRYING, f"the API server did not answer ({type(err).__name__}: {err}); retrying")
    return None


def backoff_seconds(attempt: int) -> float:
    """0.5, 1, 2, 4 ... seconds, at most 30: quick for a blip, gentle on an API server in trouble."""
    return min(BACKOFF_MAX, BACKOFF_BASE * 2 ** max(0, attempt))
