"""Asking for capacity when a request finds its model at zero replicas: the InferenceModel's /scale
subresource goes from 0 to max(1, minReplicas). The operator then promotes a warm standby (seconds) or
starts a pod (a model load). The chart grants exactly get/patch on inferencemodels/scale.

A wake-up is sized by its demand: with `spec.autoscaling`, the ask is for as many pods as the held
requests need at its targetQueueDepth (up to maxReplicas), and the hold asks again as more arrive while
nothing is ready yet. Why: the operator's autoscaler sees only the queues of ready pods, so requests
held at the gateway are invisible to it, and a burst released onto the one pod a minimal ask brought
back waits minutes (benchmarks/RESULTS.md, "A model that idles and wakes"). Replicas only ever go up
here, with the resourceVersion read: a scale the operator, an HPA or a person made meanwhile wins."""
from __future__ import annotations

import asyncio
import logging

from .model_priorities import INFERENCE_MODELS, ScaleTarget

logger = logging.getLogger(__name__)


class ScaleUp:
    def __init__(self, targets: dict[str, ScaleTarget], api_client) -> None:
        self.targets = targets  # served name -> InferenceModel, kept current by ClusterPriorities
        self.api_client = api_client

    def knows(self, model: str) -> bool:
        return model in self.targets

    async def __call__(self, model: str, held: int = 1) -> bool:
        """True when this call raised the replicas; False when the model is unknown or already has as many
        as `held` waiting requests call for."""
        target = self.targets.get(model)
        if target is None:
            return False
        return await asyncio.to_thread(self._scale_up, target, target.replicas_for(held))

    def _scale_up(self, target: ScaleTarget, replicas: int) -> bool:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        group, version, plural = INFERENCE_MODELS
        api = client.CustomObjectsApi(self.api_client)
        scale = api.get_namespaced_custom_object_scale(group, version, target.namespace, plural, target.name)
        if (scale.get("spec") or {}).get("replicas", 0) >= replicas:
            return False  # someone scaled it already: it is on its way
        body = {"metadata": {"resourceVersion": (scale.get("metadata") or {}).get("resourceVersion")},
                "spec": {"replicas": replicas}}
        try:
            api.patch_namespaced_custom_object_scale(group, version, target.namespace, plural, target.name, body,
                                                     _content_type="application/merge-patch+json")
        except ApiException as error:
            if error.status == 409:
                return False  # another writer moved it first
            raise
        logger.info("asked %s/%s for %d replica(s): requests are waiting for it", target.namespace, target.name,
                    replicas)
        return True
