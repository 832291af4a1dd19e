"""A resync pass's autoscaling: read the model's /scale, let the Autoscaler (autoscale.py) decide from the
active pods' queues, write the decision back through /scale, and say why in an Event."""
from __future__ import annotations

import logging
import time
from typing import Any

from kubeinfer.operator.autoscale import Autoscaler, QueueDepthSource
from kubeinfer.operator.kube import ApiError, KubeClient, api_path
from kubeinfer.operator.names import API_VERSION, PLURAL
from kubeinfer.operator.pods import PodView
from kubeinfer.operator.roles import RolePlan
from kubeinfer.operator.spec import InferenceModelSpec

logger = logging.getLogger(__name__)


async def autoscale_model(client: KubeClient, metrics: QueueDepthSource, autoscaler: Autoscaler,
                          body: dict[str, Any], spec: InferenceModelSpec, pods: list[PodView], plan: RolePlan) -> None:
    """Decide from the /scale subresource's replicas and write back with its resourceVersion.

    Whoever else writes spec.replicas meanwhile (kubectl scale, GitOps, an edit) wins: the API
    server answers 409 and the autoscaler decides again from the new value at the next resync.
    """
    meta = body["metadata"]
    path = api_path(API_VERSION, PLURAL, meta["namespace"], meta["name"], "scale")
    scale = await client.request("GET", path)
    if (scale.get("spec") or {}).get("replicas") != spec.replicas:
        return  # changed since this pass read the model: that pass's decision would be stale
    by_name = {p.name: p for p in pods}
    serving = [by_name[n] for n in plan.active() if by_name[n].ready]
    depths = await metrics.queue_depths(serving)
    idle = False
    if spec.min_replicas == 0 and serving:  # scale to zero only on a full reading of no work anywhere
        activity = await metrics.activity(serving)
        idle = len(activity) == len(serving) and not any(activity.values())
    wanted = autoscaler.decide(f"{meta['namespace']}/{meta['name']}", spec, list(depths.values()),
                               time.monotonic(), idle)
    if wanted == spec.replicas:
        return
    average = sum(depths.values()) / max(len(depths), 1)
    try:
        await client.patch(API_VERSION, PLURAL, meta["namespace"], meta["name"],
                           {"metadata": {"resourceVersion": scale["metadata"]["resourceVersion"]},
                            "spec": {"replicas": wanted}}, "scale")
    except ApiError as err:
        if err.status != 409:
            raise
        logger.info("%s/%s: spec.replicas changed while the autoscaler decided (%s -> %s); the other writer "
                    "wins, the next resync decides again", meta["namespace"], meta["name"], spec.replicas, wanted)
        return
    why = (f"no request for {spec.autoscaling.scale_down_delay_seconds:g} s (minReplicas 0): scaled to zero"
           if wanted == 0 else f"{average:.1f} requests waiting per active pod, target "
                               f"{spec.autoscaling.target_queue_depth:g}")
    await client.event(body, "Normal", "Autoscaled", f"spec.replicas {spec.replicas} -> {wanted}: {why}")
