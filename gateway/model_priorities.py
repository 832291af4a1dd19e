"""Routing priorities from InferenceModels: a model (and its adapters) whose `spec.routing.priority` is
below zero is sheddable. Polled from the API server on a thread; the router reads the latest map."""
from __future__ import annotations

import asyncio
import logging
import threading

logger = logging.getLogger(__name__)
GROUP, VERSION, PLURAL = "serving.kubeinfer.io", "v1alpha1", "inferencemodels"


def priorities_of(models: list[dict]) -> dict[str, int]:
    """Served name (and each adapter name) -> the InferenceModel's routing priority."""
    out: dict[str, int] = {}
    for model in models:
        spec = model.get("spec") or {}
        priority = int((spec.get("routing") or {}).get("priority", 0) or 0)
        served = (spec.get("model") or {}).get("servedName") or (model.get("metadata") or {}).get("name")
        for name in [served, *((a or {}).get("name") for a in spec.get("adapters") or [])]:
            if name:
                out[name] = priority
    return out


class InferenceModelPriorities:
    def __init__(self, target: dict[str, int], *, namespace: str | None, api_client, interval: float = 10.0) -> None:
        self.target, self.namespace, self.api_client, self.interval = target, namespace, api_client, interval
        self._stop = threading.Event()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        threading.Thread(target=self._run, name="model-priorities", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _publish(self, priorities: dict[str, int]) -> None:
        def apply() -> None:
            self.target.clear()
            self.target.update(priorities)
        self.loop.call_soon_threadsafe(apply)

    def _run(self) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        api = client.CustomObjectsApi(self.api_client)
        while not self._stop.is_set():
            try:
                if self.namespace:
                    listing = api.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)
                else:
                    listing = api.list_cluster_custom_object(GROUP, VERSION, PLURAL)
                self._publish(priorities_of(listing.get("items", [])))
            except ApiException as error:
                if error.status == 404:  # the CRD is not installed: headers alone decide
                    logger.info("no InferenceModel CRD; routing priorities come from headers only")
                    return
                logger.warning("listing InferenceModels failed: %s", error)
            except Exception as error:
                logger.warning("listing InferenceModels failed: %s", error)
            self._stop.wait(self.interval)
