"""Keeps the current objects of one custom resource (all of them, or one namespace's) by listing them,
then watching, on a thread of its own (the kubernetes client is synchronous).

Why a watch: the gateway routes, holds and scales up by what InferenceModels say, so a model created or
edited a moment ago must count at once (a poll every 10 s refused a new model's first requests). Each
event republishes the whole set (`publish(objects)`), which the readers turn into their maps. A watch
ends every `resync` seconds and the list that follows is the safety net: anything a broken watch
missed (a server that drops events, an expired resourceVersion) is corrected by then.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)
RETRY_SECONDS = 1.0  # after a failed list or watch


class CrdMissing(Exception):
    """The resource's CRD is not installed (the list answered 404)."""


class ResourceWatch:
    def __init__(self, resource: tuple[str, str, str], publish: Callable[[list[dict]], None], *,
                 namespace: str | None, api_client, resync: float, stop: threading.Event) -> None:
        self.group, self.version, self.plural = resource
        self.publish, self.namespace, self.api_client = publish, namespace, api_client
        self.resync, self._stop = resync, stop
        self.lists = 0  # successful lists (the first one and each resync)
        self.events = 0  # watch events applied
        self._objects: dict[tuple[str, str], dict] = {}
        self._last_error: str | None = None
        self._watch = None  # the open watch, closed by stop() so a shutdown does not wait for it

    def run(self) -> None:
        """Until stopped; returns early (raising CrdMissing) when the CRD is not installed."""
        from kubernetes import client, watch
        from kubernetes.client.exceptions import ApiException

        api = client.CustomObjectsApi(self.api_client)
        lister, args = self._lister(api)
        while not self._stop.is_set():
            try:
                try:
                    listing = lister(*args)
                except ApiException as error:
                    if error.status == 404:
                        raise CrdMissing(f"no {self.plural} CRD ({self.group}/{self.version})") from None
                    raise
                self._objects = {_key(o): o for o in listing.get("items") or []}
                self.lists += 1
                self._last_error = None
                self.publish(list(self._objects.values()))
                self._watch = watch.Watch()
                stream = self._watch.stream(
                    lister, *args, timeout_seconds=max(1, int(self.resync)), _request_timeout=self.resync + 10,
                    resource_version=(listing.get("metadata") or {}).get("resourceVersion"))
                for event in stream:
                    if self._stop.is_set():
                        return
                    self._apply(event)
            except CrdMissing:
                raise
            except Exception as error:  # noqa: BLE001 - API server hiccup, expired resourceVersion: list again shortly
                if self._stop.is_set():
                    return  # stop() closed the watch under it
                message = f"watching {self.plural} failed: {type(error).__name__}: {error}".splitlines()[0]
                if message != self._last_error:
                    logger.warning("%s; listing again", message)
                self._last_error = message
                self._stop.wait(RETRY_SECONDS)

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()  # closes its connection: the thread's blocked read ends now

    def _apply(self, event: dict) -> None:
        kind, obj = event.get("type"), event.get("object")
        if kind == "ERROR" or not isinstance(obj, dict):  # e.g. 410 Gone: the caller lists again
            raise RuntimeError(f"watch error event: {obj}")
        if kind == "DELETED":
            self._objects.pop(_key(obj), None)
        else:  # ADDED, MODIFIED (BOOKMARK carries no object of interest)
            if kind == "BOOKMARK":
                return
            self._objects[_key(obj)] = obj
        self.events += 1
        self.publish(list(self._objects.values()))

    def _lister(self, api):
        if self.namespace:
            return api.list_namespaced_custom_object, (self.group, self.version, self.namespace, self.plural)
        return api.list_cluster_custom_object, (self.group, self.version, self.plural)


def _key(obj: dict) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""
