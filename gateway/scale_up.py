"""Asking for capacity when a request finds its model at zero replicas: the InferenceModel's /scale
subresource goes from 0 to max(1, minReplicas). The operator then promotes a warm standby (seconds) or
starts a pod (a model load). Only a model at 0 is touched, with the resourceVersion read, so a scale
the operator, an HPA or a person made meanwhile wins. The chart grants exactly get/patch on
inferencemodels/scale."""
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

    async def __call__(self, model: str) -> bool:
        """True when this call set the replicas; False when the model is unknown or not at zero."""
        target = self.targets.get(model)
        if target is None:
            return False
        return await asyncio.to_thread(self._scale_up, target)

    def _scale_up(self, target: ScaleTarget) -> bool:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        group, version, plural = INFERENCE_MODELS
        api = client.CustomObjectsApi(self.api_client)
        scale = api.get_namespaced_custom_object_scale(group, version, target.namespace, plural, target.name)
        if (scale.get("spec") or {}).get("replicas", 0) > 0:
            return False  # someone scaled it already: it is on its way
        replicas = max(1, target.min_replicas)
        body = {"metadata": {"resourceVersion": (scale.get("metadata") or {}).get("resourceVersion")},
                "spec": {"replicas": replicas}}
        try:
            api.patch_namespaced_custom_object_scale(group, version, target.namespace, plural, target.name, body,
                                                     _content_type="application/merge-patch+json")
        except ApiException as error:
            if error.status == 409:
                return False  # another writer moved it first
            raise
        logger.info("asked %s/%s for %d replica(s): a request is waiting for it", target.namespace, target.name,
                    replicas)
        return True
