"""Routing priorities from the cluster, watched through the API server (resource_watch.py: a list,
then a watch, re-listed every `resync` seconds as a safety net); the router reads the latest maps.
Below zero a request is sheddable.

  * our InferenceModels: a model (and its adapters) gets its `spec.routing.priority`;
  * the Inference Extension's InferenceObjectives (`inference.networking.x-k8s.io/v1alpha2`): a request
    naming one in the `x-gateway-inference-objective` header gets its `spec.priority`.
The same InferenceModels give each model's fallbacks (`spec.routing.fallback`) and name what to scale
up when a request finds a model at zero (`scale_targets_of`, for scale_up.ScaleUp). A model created
or edited counts within a watch event's delay (milliseconds), so its first request is held or routed.
A resource whose CRD is not installed is left out (headers alone decide for it) and looked for again
every `resync` seconds.
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
from dataclasses import dataclass

from kubeinfer.common.inference_model import read_inference_model

from ..datastore.resource_watch import CrdMissing, ResourceWatch
from .fallback import fallbacks_of

logger = logging.getLogger(__name__)
INFERENCE_MODELS = ("serving.kubeinfer.io", "v1alpha1", "inferencemodels")
INFERENCE_OBJECTIVES = ("inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives")


def priorities_of(models: list[dict]) -> dict[str, int]:
    """Served name (and each adapter name) -> the InferenceModel's routing priority."""
    out: dict[str, int] = {}
    for obj in models:
        model, _ = read_inference_model(obj)  # the operator reports the problems; routing goes on
        for name in model.client_names:
            out[name] = model.routing.priority
    return out


@dataclass(frozen=True)
class ScaleTarget:
    namespace: str
    name: str  # the InferenceModel's
    min_replicas: int
    max_replicas: int | None = None
    target_queue_depth: float | None = None  # spec.autoscaling's: sizes a wake-up by the requests held

    def replicas_for(self, held: int) -> int:
        """What to ask for with `held` requests waiting: max(1, minReplicas), or as many pods as the
        autoscaler would want for that queue (held / targetQueueDepth), up to maxReplicas."""
        wanted = max(1, self.min_replicas)
        if self.target_queue_depth:
            wanted = max(wanted, math.ceil(held / self.target_queue_depth))
        return wanted if self.max_replicas is None else min(wanted, max(1, self.max_replicas))


def scale_targets_of(models: list[dict]) -> dict[str, ScaleTarget]:
    """Served name (and each adapter name) -> the InferenceModel whose /scale brings it back from zero."""
    out: dict[str, ScaleTarget] = {}
    for obj in models:
        model, _ = read_inference_model(obj)
        if not model.name or not model.namespace:
            continue
        auto = model.autoscaling
        target = ScaleTarget(model.namespace, model.name, model.min_replicas, model.max_replicas,
                             auto.target_queue_depth if auto is not None else None)
        for name in model.client_names:
            out[name] = target
    return out


def objective_priorities_of(objectives: list[dict]) -> dict[str, int]:
    """InferenceObjective name -> its priority (0 when unset)."""
    return {o["metadata"]["name"]: int((o.get("spec") or {}).get("priority", 0) or 0)
            for o in objectives if (o.get("metadata") or {}).get("name")}


class ClusterPriorities:
    def __init__(self, models: dict[str, int], objectives: dict[str, int], *, namespace: str | None, api_client,
                 interval: float = 60.0, scale_targets: dict[str, ScaleTarget] | None = None,
                 fallbacks: dict[str, list[str]] | None = None) -> None:
        """Keeps `models` (served name -> priority), `objectives` (objective name -> priority),
        `scale_targets` (served name -> InferenceModel) and `fallbacks` current. `interval`: seconds
        between the re-lists that back the watch up."""
        self.namespace, self.api_client, self.interval = namespace, api_client, interval
        self.sources = {INFERENCE_MODELS: [(priorities_of, models)],
                        INFERENCE_OBJECTIVES: [(objective_priorities_of, objectives)]}
        if scale_targets is not None:
            self.sources[INFERENCE_MODELS].append((scale_targets_of, scale_targets))
        if fallbacks is not None:  # served name -> spec.routing.fallback
            self.sources[INFERENCE_MODELS].append((fallbacks_of, fallbacks))
        self.watches: dict[tuple[str, str, str], ResourceWatch] = {}
        self._stop = threading.Event()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        for resource in self.sources:
            threading.Thread(target=self._run, args=(resource,), name=f"watch-{resource[2]}", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        for watch in list(self.watches.values()):
            watch.stop()

    def _publisher(self, resource: tuple[str, str, str]):
        readers = self.sources[resource]

        def publish(objects: list[dict]) -> None:
            parsed = [(target, parse(objects)) for parse, target in readers]  # parsed here, off the loop

            def apply() -> None:
                for target, values in parsed:
                    target.clear()
                    target.update(values)
            self.loop.call_soon_threadsafe(apply)
        return publish

    def _run(self, resource: tuple[str, str, str]) -> None:
        watch = self.watches[resource] = ResourceWatch(resource, self._publisher(resource), namespace=self.namespace,
                                                       api_client=self.api_client, resync=self.interval,
                                                       stop=self._stop)
        said = False
        while not self._stop.is_set():
            try:
                watch.run()
            except CrdMissing as missing:  # headers alone decide; a CRD installed later is found at a resync
                if not said:
                    logger.info("%s; leaving it out of routing until it appears", missing)
                said = True
                self._stop.wait(self.interval)
