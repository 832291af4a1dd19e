"""One pass's writes of the objects a model owns: the Deployment or LeaderWorkerSet, Service, PDB, InferencePool
and NetworkPolicies (builders.py says what they are), re-applied in full on a new generation and otherwise
only where a watched one drifted; the workload of the other shape goes once the new one serves."""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kubeinfer.operator.builders import GROUP_POLICY_INFIX, desired_objects, group_network_policies
from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.drift import controller_of, owned_drift
from kubeinfer.operator.kube import KubeClient
from kubeinfer.operator.leader_worker import LWS_API_VERSION, LWS_PLURAL, SET_NAME_LABEL, lws_name, multi_node
from kubeinfer.operator.model_state import ModelState
from kubeinfer.operator.names import POOL_GROUP, POOL_PLURAL, POOL_VERSION
from kubeinfer.operator.pods import PodView
from kubeinfer.operator.spec import InferenceModelSpec

logger = logging.getLogger(__name__)
CrdExists = Callable[[str, str], Awaitable[bool]]  # (apiVersion, plural) -> is that optional API served?


async def apply_owned(client: KubeClient, config: OperatorConfig, crd_exists: CrdExists, body: dict[str, Any],
                      spec: InferenceModelSpec, state: ModelState, generation: int) -> None:
    """Everything on a new generation; otherwise only the watched objects that drifted (no write if none)."""
    suspects, state.suspects = state.suspects, set()
    full = state.applied != generation
    for obj in desired_objects(body, spec, config, await crd_exists(f"{POOL_GROUP}/{POOL_VERSION}", POOL_PLURAL)):
        kind = obj["kind"]
        state.desired[kind] = obj
        if not full:
            if kind not in suspects:
                continue
            where = owned_drift(obj, state.observed.get(kind))
            if not where:
                continue
            message = f"{kind} {obj['metadata']['name']} drifted ({', '.join(where[:4])}): re-applied"
            logger.info("%s/%s: %s", obj["metadata"]["namespace"], spec.name, message)
            await client.event(body, "Normal", "DriftRepaired", message)
        await client.apply(obj)
    if full and not config.network_policy:
        await remove_network_policy(client, body)
    state.applied = generation


async def apply_group_policies(client: KubeClient, config: OperatorConfig, body: dict[str, Any],
                               spec: InferenceModelSpec) -> None:
    """One NetworkPolicy per group of a multi-node model; those of groups scaled away go."""
    meta = body["metadata"]
    wanted = group_network_policies(body, spec) if config.network_policy else []
    for obj in wanted:
        await client.apply(obj)
    names = {obj["metadata"]["name"] for obj in wanted}
    for found in await client.list("networking.k8s.io/v1", "networkpolicies", meta["namespace"]):
        name = found["metadata"]["name"]
        if (name.startswith(meta["name"] + GROUP_POLICY_INFIX) and name not in names
                and controller_of(found) == meta["name"]):
            await client.delete("networking.k8s.io/v1", "networkpolicies", meta["namespace"], name)


async def remove_network_policy(client: KubeClient, body: dict[str, Any]) -> None:
    """--no-network-policy: the policy an earlier run built goes (only ours: a user's own is left alone)."""
    meta = body["metadata"]
    found = await client.get("networking.k8s.io/v1", "networkpolicies", meta["namespace"], meta["name"])
    if found and controller_of(found) == meta["name"]:
        await client.delete("networking.k8s.io/v1", "networkpolicies", meta["namespace"], meta["name"])


async def retire_other_shape(client: KubeClient, crd_exists: CrdExists, body: dict[str, Any],
                             spec: InferenceModelSpec, found: list[dict[str, Any]], units: list[PodView],
                             full: bool) -> None:
    """After nodes moved between 1 and more, the workload of the other shape (Deployment or LeaderWorkerSet)
    goes, but only once the new one serves (its pods keep their role labels, and so their traffic, until
    then). Looked for on a new generation and while such pods exist: no extra call on other passes."""
    multi = multi_node(spec)
    others = [p for p in found if (SET_NAME_LABEL in ((p.get("metadata") or {}).get("labels") or {})) != multi]
    if not (full or others) or (others and spec.replicas > 0 and not any(u.ready for u in units)):
        return
    meta = body["metadata"]
    if multi:
        api_version, plural, name = "apps/v1", "deployments", meta["name"]
    elif await crd_exists(LWS_API_VERSION, LWS_PLURAL):
        api_version, plural, name = LWS_API_VERSION, LWS_PLURAL, lws_name(meta["name"])
    else:
        return
    old = await client.get(api_version, plural, meta["namespace"], name)
    if old and controller_of(old) == meta["name"]:
        await client.delete(api_version, plural, meta["namespace"], name)
        await client.event(body, "Normal", "WorkloadReplaced",
                           f"{old['kind']} {name} deleted: spec.engine.parallelism.nodes is now "
                           f"{spec.engine.parallelism.nodes}")
