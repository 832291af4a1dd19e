"""A small async Kubernetes API client for the objects the operator writes.

It reuses kopf's ConnectionInfo (the same credentials kopf logged in with) and speaks plain REST:
server-side apply for owned objects, merge patches for pod labels and status, core/v1 Events.
"""
from __future__ import annotations

import datetime
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf

from kubeinfer.operator.names import MANAGER, matches

PLURALS = {"Deployment": "deployments", "Service": "services", "PodDisruptionBudget": "poddisruptionbudgets",
           "InferencePool": "inferencepools", "NetworkPolicy": "networkpolicies", "Pod": "pods", "Event": "events",
           "InferenceModel": "inferencemodels", "Secret": "secrets",
           "LeaderWorkerSet": "leaderworkersets"}
MERGE = "application/merge-patch+json"
APPLY = "application/apply-patch+yaml"  # JSON is YAML
logger = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, method: str, url: str, body: str):
        try:
            parsed = json.loads(body)
            message = parsed.get("message", body)
            causes = [c.get("reason") for c in (parsed.get("details") or {}).get("causes") or [] if isinstance(c, dict)]
        except (ValueError, AttributeError):
            message, causes = body, []
        super().__init__(f"{method} {url}: HTTP {status}: {message}")
        self.status, self.method, self.path, self.message = status, method, url, str(message)
        self.causes: tuple[str, ...] = tuple(str(c) for c in causes if c)  # the Status's details.causes[].reason


def api_path(api_version: str, plural: str, namespace: str | None = None, name: str | None = None,
             subresource: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{quote(namespace)}/{plural}" if namespace else f"{base}/{plural}"
    path += f"/{quote(name)}" if name else ""
    return path + (f"/{subresource}" if subresource else "")


class KubeClient:
    """`connect()` gives the credentials; it is asked again after a 401 (rotated service-account tokens)."""

    def __init__(self, connect: Callable[[], Awaitable[kopf.ConnectionInfo]]):
        self._connect = connect
        self._session: aiohttp.ClientSession | None = None
        self._server = ""

    async def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            info = await self._connect()
            self._server = info.server.rstrip("/")
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()), headers=info.as_http_headers(),
                timeout=aiohttp.ClientTimeout(total=30))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                      params: dict[str, str] | None = None) -> Any:
        for attempt in range(2):
            session = await self._open()
            data = None if body is None else json.dumps(body)
            async with session.request(method, self._server + path, data=data, params=params,
                                       headers={"Content-Type": content_type}) as response:
                text = await response.text()
                if response.status == 401 and attempt == 0:
                    await self.close()
                    continue
                if response.status >= 400:
                    raise ApiError(response.status, method, path, text)
                return json.loads(text) if text else None
        raise AssertionError("unreachable")

    async def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", api_path(api_version, plural, namespace, name))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def list(self, api_version: str, plural: str, namespace: str | None = None,
                   labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        labels = labels or {}
        params = {"labelSelector": ",".join(f"{k}={v}" for k, v in labels.items())} if labels else None
        result = await self.request("GET", api_path(api_version, plural, namespace), params=params)
        # Filter again: the selector is a server-side optimisation some API emulators ignore.
        return [item for item in result.get("items") or [] if matches(item["metadata"].get("labels"), labels)]

    async def resource_exists(self, api_version: str, plural: str) -> bool:
        try:
            found = await self.request("GET", "/api/v1" if api_version == "v1" else f"/apis/{api_version}")
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in (found or {}).get("resources") or [])

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: fields we stop setting are removed, fields others own are kept."""
        meta = obj["metadata"]
        path = api_path(obj["apiVersion"], PLURALS[obj["kind"]], meta.get("namespace"), meta["name"])
        params = {"fieldManager": MANAGER, "force": "true"}
        try:
            return await self.request("PATCH", path, obj, APPLY, params)
        except ApiError as err:
            if err.status != 404:  # the real API server creates on apply; some emulators answer 404
                raise
        try:
            return await self.request("POST", api_path(obj["apiVersion"], PLURALS[obj["kind"]], meta.get("namespace")),
                                      obj)
        except ApiError as err:
            if err.status != 409:  # created meanwhile (a replayed watch event): apply over it
                raise
            return await self.request("PATCH", path, obj, APPLY, params)

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj` unless an object of its name exists (409): never overwrites. True when created."""
        meta = obj["metadata"]
        try:
            await self.request("POST", api_path(obj["apiVersion"], PLURALS[obj["kind"]], meta.get("namespace")), obj)
        except ApiError as err:
            if err.status != 409:
                raise
            return False
        return True

    async def delete(self, api_version: str, plural: str, namespace: str | None, name: str) -> bool:
        """Delete one object; False when it was already gone."""
        try:
            await self.request("DELETE", api_path(api_version, plural, namespace, name))
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        return True

    async def patch(self, api_version: str, plural: str, namespace: str | None, name: str, body: dict[str, Any],
                    subresource: str | None = None) -> dict[str, Any]:
        return await self.request("PATCH", api_path(api_version, plural, namespace, name, subresource), body, MERGE)

    async def event(self, involved: dict[str, Any], kind: str, reason: str, message: str) -> None:
        """A core/v1 Event on `involved` (shown by kubectl describe); never fails the caller."""
        meta = involved["metadata"]
        now = datetime.datetime.now(datetime.UTC)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": involved["apiVersion"], "kind": involved["kind"], "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid", "")},
            "type": kind, "reason": reason, "message": message[:1024], "count": 1,
            "firstTimestamp": stamp, "lastTimestamp": stamp, "source": {"component": MANAGER},
            "reportingComponent": MANAGER, "reportingInstance": MANAGER,
        }
        try:
            await self.request("POST", api_path("v1", "events", meta["namespace"]), event)
        except (ApiError, aiohttp.ClientError) as err:
            logger.warning("could not record event %s on %s: %s", reason, meta["name"], err)
