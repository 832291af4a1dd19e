"""One level-based pass over an InferenceModel: read the world, compute the desired state, write the difference.

Every pass starts from what the API server says now, never from what an earlier pass did, so any
pass can be repeated, interrupted or skipped. Passes for one model never overlap: a trigger that
arrives during a pass makes that pass run once more instead (coalescing bursts of pod events).
A pass that fails on the API is classified (errors.py): retried with backoff, or reported as
Forbidden or InvalidSpec in status, one log line per distinct failure.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from kubeinfer.operator.autoscale import Autoscaler, HttpQueueDepths, QueueDepthSource
from kubeinfer.operator.builders import GROUP_POLICY_INFIX, desired_objects, group_network_policies, group_secret
from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.drift import controller_of, owned_drift
from kubeinfer.operator.errors import FORBIDDEN, INVALID, Failure, backoff_seconds, classify
from kubeinfer.operator.groups import serving_units
from kubeinfer.operator.kube import ApiError, KubeClient, api_path
from kubeinfer.operator.leader_worker import (LWS_API_VERSION, LWS_MISSING, LWS_PLURAL, SET_NAME_LABEL,
                                              lws_missing_message, lws_name, multi_node)
from kubeinfer.operator.loaded import HttpLoadedAdapters, LoadedAdapterSource, Observed
from kubeinfer.operator.names import (ACTIVE, ADAPTERS_ANNOTATION, API_VERSION, DELETION_COST_ANNOTATION, PLURAL,
                                      POOL_GROUP, POOL_PLURAL, POOL_VERSION, ROLE_LABEL, selector_labels)
from kubeinfer.operator.placement import Placement, place_adapters
from kubeinfer.operator.policy import POLICY_VIOLATION, violations
from kubeinfer.operator.pods import PodView
from kubeinfer.operator.roles import RolePlan, assign_roles
from kubeinfer.operator.served_names import SERVED_NAME_CONFLICT, conflict_message, rivals
from kubeinfer.operator.spec import InferenceModelSpec, SpecError, parse_spec
from kubeinfer.operator.status import build_status, failure_status, invalid_status, now_rfc3339
from kubeinfer.operator.template_hash import current_template

logger = logging.getLogger(__name__)
DELETION_COST = {ACTIVE: "100"}  # standby pods keep the default 0 and go first on a scale-down
CRD_CHECK_SECONDS = 60.0
RESYNC_CONCURRENCY = 16
ADAPTER_RECHECK_SECONDS = 5.0  # engines load adapters after the annotation reaches them: look again soon


@dataclass
class ModelState:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    dirty: bool = False
    autoscale: bool = False  # a resync asked for autoscaling; survives coalescing into a running pass
    applied: int | None = None  # generation whose owned objects were all applied
    observed: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # kind -> last watched (None: deleted)
    suspects: set[str] = field(default_factory=set)  # kinds watched changing since the last pass
    desired: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> what the last pass would apply
    invalid_reported: tuple[int, str] | None = None  # (generation, reason) whose refusal Event was recorded
    failure_reported: str | None = None  # the last failure logged: one line per distinct failure, not per pass
    attempts: int = 0  # consecutive retried failures (the backoff exponent)
    later: asyncio.Task[None] | None = None  # a pass scheduled for later (retry, adapter re-check)


class Reconciler:
    def __init__(self, client: KubeClient, config: OperatorConfig | None = None,
                 metrics: QueueDepthSource | None = None, engines: LoadedAdapterSource | None = None):
        self.client = client
        self.config = config or OperatorConfig()
        self.metrics = metrics or HttpQueueDepths(api_key=self.config.engine_api_key)
        self.engines = engines or HttpLoadedAdapters(api_key=self.config.engine_api_key)
        self.autoscaler = Autoscaler()
        self.states: dict[tuple[str, str], ModelState] = defaultdict(ModelState)
        self._crds_known: dict[str, tuple[bool, float]] = {}  # plural -> (served, when asked)
        self._resync: asyncio.Task[None] | None = None
        self.conflicted: set[tuple[str, str]] = set()  # models refused for a servedName an older model holds

    def start_resync(self, interval: float) -> None:
        self._resync = asyncio.create_task(self._resync_forever(interval))

    async def stop_resync(self) -> None:
        tasks = [t for t in [self._resync, *(s.later for s in self.states.values())] if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._resync = None

    async def _resync_forever(self, interval: float) -> None:
        """Every `interval`, a pass with autoscaling over every known model, RESYNC_CONCURRENCY at a time."""
        limit = asyncio.Semaphore(RESYNC_CONCURRENCY)

        async def one(namespace: str, name: str) -> None:
            async with limit:
                try:
                    await self.trigger(namespace, name, autoscale=True)
                except Exception:  # one broken model must not stop the others' resync
                    logger.exception("resync of %s/%s failed", namespace, name)
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(one(ns, name) for ns, name in list(self.states)))

    def forget(self, namespace: str, name: str) -> None:
        self.conflicted.discard((namespace, name))
        self._recheck_conflicts(namespace)  # the name it held may be free now
        state = self.states.pop((namespace, name), None)
        if state is not None and state.later is not None and state.later is not asyncio.current_task():
            state.later.cancel()
        self.autoscaler.forget(f"{namespace}/{name}")

    def _recheck_conflicts(self, namespace: str) -> None:
        for ns, name in sorted(self.conflicted):
            if ns == namespace and (ns, name) in self.states:
                self.states[(ns, name)].applied = None
                self._later(ns, name, 0)

    async def owned_changed(self, namespace: str, model: str, kind: str, obj: dict[str, Any] | None) -> None:
        """A watched owned object changed (None: deleted): a pass repairs it if it drifted."""
        state = self.states[(namespace, model)]
        state.observed[kind] = obj
        desired = state.desired.get(kind)
        if desired is not None and not owned_drift(desired, obj):
            return  # the usual case (our own apply, a controller's status): no pass, no request
        state.suspects.add(kind)
        await self.trigger(namespace, model)

    async def trigger(self, namespace: str, name: str, apply: bool = False, autoscale: bool = False) -> None:
        """Run a pass for one model now, or make the running one go again."""
        state = self.states[(namespace, name)]
        state.dirty = True
        state.autoscale |= autoscale
        if apply:
            state.applied = None
        if state.lock.locked():
            return
        async with state.lock:
            while state.dirty:
                state.dirty, wants_autoscale, state.autoscale = False, state.autoscale, False
                try:
                    await self._pass(namespace, name, state, wants_autoscale)
                except Exception as err:
                    failure = classify(err)
                    if failure is None:
                        raise  # a bug, not the API: let the caller's log show the traceback
                    await self._report_failure(namespace, name, state, failure)
                    return
                if state.failure_reported is not None:
                    logger.info("%s/%s: reconciled again after: %s", namespace, name, state.failure_reported)
                state.attempts, state.failure_reported = 0, None

    def _later(self, namespace: str, name: str, delay: float) -> None:
        """One pass for this model after `delay`, unless one is already scheduled."""
        state = self.states[(namespace, name)]
        if state.later is not None and not state.later.done():
            return

        async def run() -> None:
            await asyncio.sleep(delay)
            state.later = None  # a failure inside may schedule the next try
            if (namespace, name) in self.states:
                try:
                    await self.trigger(namespace, name)
                except Exception:
                    logger.exception("scheduled pass over %s/%s failed", namespace, name)
        state.later = asyncio.create_task(run())

    async def _report_failure(self, namespace: str, name: str, state: ModelState, failure: Failure) -> None:
        """Retry with backoff, or say in status why not; one log line per distinct failure."""
        first = state.failure_reported != failure.message
        state.failure_reported = failure.message
        if failure.retry:
            delay = backoff_seconds(state.attempts)
            state.attempts += 1
            self._later(namespace, name, delay)
            (logger.warning if first else logger.debug)("%s/%s: %s (next try in %.1f s)", namespace, name,
                                                        failure.message, delay)
        else:
            logger.log(failure.log_level if first else logging.DEBUG, "%s/%s: %s", namespace, name, failure.message)
        try:
            body = await self.client.get(API_VERSION, PLURAL, namespace, name)
            if body is None:
                return
            if failure.reason == INVALID:
                await self._report_invalid(body, failure.message, state, int(body["metadata"].get("generation") or 0))
                return
            await self._write_status(body, failure_status(failure, body, now_rfc3339()))
            if first and failure.reason == FORBIDDEN:
                await self.client.event(body, "Warning", FORBIDDEN, failure.message)
        except Exception as err:
            if classify(err) is None:
                raise
            if first:
                logger.warning("%s/%s: could not record that in status either: %s", namespace, name, err)

    async def _pass(self, namespace: str, name: str, state: ModelState, autoscale: bool) -> None:
        body = await self.client.get(API_VERSION, PLURAL, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)  # owner references let the garbage collector remove what we built
            return
        generation = int(body["metadata"].get("generation") or 0)
        try:
            spec = parse_spec(name, body.get("spec") or {})
        except SpecError as err:
            await self._report_invalid(body, str(err), state, generation)
            return
        if problems := violations(spec, self.config.policy, self.config.engine_image):
            await self._report_invalid(body, "; ".join(problems), state, generation, POLICY_VIOLATION)
            return
        if state.applied != generation and not await self._claim_served_name(body, state, generation):
            return
        if multi_node(spec) and not await self._crd_exists(LWS_API_VERSION, LWS_PLURAL):
            await self._report_invalid(body, lws_missing_message(spec), state, generation, LWS_MISSING,
                                       "install the LeaderWorkerSet controller; nothing is built until then")
            return
        full = state.applied != generation
        if full and multi_node(spec):  # before the pods that read it
            await self.client.create(group_secret(body, spec))
        await self._apply_owned(body, spec, state, generation)
        if full and multi_node(spec):
            await self._apply_group_policies(body, spec)
        found = await self.client.list("v1", "pods", namespace, selector_labels(name))
        pods = serving_units(found, spec.engine.parallelism.nodes)
        plan = await self._apply_roles(body, spec, pods)
        await self._retire_other_shape(body, spec, found, pods, full)
        placement = await self._apply_placement(body, spec, pods, plan)
        observed = await self._observe_adapters(spec, pods, placement)
        template = current_template(state.desired.get("LeaderWorkerSet" if multi_node(spec) else "Deployment"))
        status = build_status(body, spec, pods, plan, placement, now_rfc3339(), observed, template)
        await self._write_status(body, status)
        placed = next(c for c in status["conditions"] if c["type"] == "AdaptersPlaced")
        if placed["reason"] == "NotLoaded":
            self._later(namespace, name, min(ADAPTER_RECHECK_SECONDS, self.config.resync_seconds))
        if autoscale and spec.autoscaling is not None:
            await self._autoscale(body, spec, pods, plan)

    async def _apply_owned(self, body: dict[str, Any], spec: InferenceModelSpec, state: ModelState,
                           generation: int) -> None:
        """Everything on a new generation; otherwise only the watched objects that drifted (no write if none)."""
        suspects, state.suspects = state.suspects, set()
        full = state.applied != generation
        for obj in desired_objects(body, spec, self.config, await self._crd_exists(f"{POOL_GROUP}/{POOL_VERSION}",
                                                                                   POOL_PLURAL)):
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
                await self.client.event(body, "Normal", "DriftRepaired", message)
            await self.client.apply(obj)
        if full and not self.config.network_policy:
            await self._remove_network_policy(body)
        state.applied = generation

    async def _apply_group_policies(self, body: dict[str, Any], spec: InferenceModelSpec) -> None:
        """One NetworkPolicy per group of a multi-node model; those of groups scaled away go."""
        meta = body["metadata"]
        wanted = group_network_policies(body, spec) if self.config.network_policy else []
        for obj in wanted:
            await self.client.apply(obj)
        names = {obj["metadata"]["name"] for obj in wanted}
        for found in await self.client.list("networking.k8s.io/v1", "networkpolicies", meta["namespace"]):
            name = found["metadata"]["name"]
            if (name.startswith(meta["name"] + GROUP_POLICY_INFIX) and name not in names
                    and controller_of(found) == meta["name"]):
                await self.client.delete("networking.k8s.io/v1", "networkpolicies", meta["namespace"], name)

    async def _remove_network_policy(self, body: dict[str, Any]) -> None:
        """--no-network-policy: the policy an earlier run built goes (only ours: a user's own is left alone)."""
        meta = body["metadata"]
        found = await self.client.get("networking.k8s.io/v1", "networkpolicies", meta["namespace"], meta["name"])
        if found and controller_of(found) == meta["name"]:
            await self.client.delete("networking.k8s.io/v1", "networkpolicies", meta["namespace"], meta["name"])

    async def _retire_other_shape(self, body: dict[str, Any], spec: InferenceModelSpec, found: list[dict[str, Any]],
                                  units: list[PodView], full: bool) -> None:
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
        elif await self._crd_exists(LWS_API_VERSION, LWS_PLURAL):
            api_version, plural, name = LWS_API_VERSION, LWS_PLURAL, lws_name(meta["name"])
        else:
            return
        old = await self.client.get(api_version, plural, meta["namespace"], name)
        if old and controller_of(old) == meta["name"]:
            await self.client.delete(api_version, plural, meta["namespace"], name)
            await self.client.event(body, "Normal", "WorkloadReplaced",
                                    f"{old['kind']} {name} deleted: spec.engine.parallelism.nodes is now "
                                    f"{spec.engine.parallelism.nodes}")

    async def _claim_served_name(self, body: dict[str, Any], state: ModelState, generation: int) -> bool:
        """False (and the model refused) when an older live model in the namespace serves the same name."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        older, newer = rivals(body, await self.client.list(API_VERSION, PLURAL, meta["namespace"]))
        if older:
            self.conflicted.add(key)
            await self._report_invalid(body, conflict_message(body, older), state, generation, SERVED_NAME_CONFLICT)
            return False
        self.conflicted.discard(key)
        # Newer claimants may have built before this model took the name; refused ones may claim a name
        # this model just gave up: both check again.
        self.conflicted.update((meta["namespace"], name) for name in newer)
        self._recheck_conflicts(meta["namespace"])
        return True

    async def _report_invalid(self, body: dict[str, Any], message: str, state: ModelState, generation: int,
                              reason: str = INVALID, progress: str | None = None) -> None:
        """Refuse the spec (InvalidSpec, PolicyViolation, ServedNameConflict): status says why, nothing is built."""
        if state.applied is not None or await self.client.get("apps/v1", "deployments", body["metadata"]["namespace"],
                                                             body["metadata"]["name"]):
            message += "; the last accepted spec keeps running until this is fixed"
        previous = (body.get("status") or {}).get("conditions") or []
        await self._write_status(body, invalid_status(message, previous, generation, now_rfc3339(), reason, progress))
        if state.invalid_reported != (generation, reason):
            state.invalid_reported = (generation, reason)
            await self.client.event(body, "Warning", reason, message)

    async def _crd_exists(self, api_version: str, plural: str) -> bool:
        """Is this optional API served (InferencePool, LeaderWorkerSet)? Asked again after CRD_CHECK_SECONDS."""
        now = time.monotonic()
        known = self._crds_known.get(plural)
        if known is None or now - known[1] > CRD_CHECK_SECONDS:
            known = self._crds_known[plural] = (await self.client.resource_exists(api_version, plural), now)
        return known[0]

    async def _patch_pod(self, namespace: str, pod: str, labels: dict[str, Any] | None = None,
                         annotations: dict[str, Any] | None = None) -> None:
        meta = {key: value for key, value in (("labels", labels), ("annotations", annotations)) if value is not None}
        await self.client.patch("v1", "pods", namespace, pod, {"metadata": meta})

    async def _apply_roles(self, body: dict[str, Any], spec: InferenceModelSpec, pods: list[PodView]) -> RolePlan:
        namespace = body["metadata"]["namespace"]
        plan = assign_roles(pods, spec.replicas)
        for pod, role in sorted(plan.changes(pods).items()):
            await self._patch_pod(namespace, pod, labels={ROLE_LABEL: role},
                                  annotations={DELETION_COST_ANNOTATION: DELETION_COST.get(role, "0")})
        if plan.promoted:
            lost = [p.name for p in pods if p.role == ACTIVE and p.name not in plan.active()]
            why = f" replacing {', '.join(lost)}" if lost else " (scale-up)"
            await self.client.event(body, "Normal", "StandbyPromoted",
                                    f"promoted ready standby pod(s) {', '.join(plan.promoted)} to active{why}")
        return plan

    async def _apply_placement(self, body: dict[str, Any], spec: InferenceModelSpec, pods: list[PodView],
                               plan: RolePlan) -> Placement | None:
        namespace = body["metadata"]["namespace"]
        by_name = {p.name: p for p in pods}
        active = plan.active()
        # Adapters go where requests can be served now; until a pod is ready, on any active pod.
        targets = [n for n in active if by_name[n].ready] or active
        current = {p.name: p.adapters for p in pods}
        placement = None
        wanted: dict[str, tuple[str, ...]] = {}
        if spec.adapters and targets:
            placement = place_adapters([a.name for a in spec.adapters], targets, current,
                                       spec.adapter_pool.replicas_per_adapter,
                                       spec.adapter_pool.max_loras_per_replica)
            wanted.update(placement.assignment)
        for name, role in plan.roles.items():
            if role != ACTIVE:
                wanted[name] = ()  # standby pods hold nothing: adapters load in seconds on promotion
        known = {a.name for a in spec.adapters}
        for name in active:  # active pods left out keep what they hold, minus adapters no longer in the spec
            wanted.setdefault(name, tuple(a for a in current.get(name, ()) if a in known))
        changed = {n: a for n, a in wanted.items() if tuple(current.get(n, ())) != a}
        for pod, adapters in sorted(changed.items()):
            await self._patch_pod(namespace, pod, annotations={ADAPTERS_ANNOTATION: ",".join(adapters)})
        if changed:
            summary = "; ".join(f"{pod}: {','.join(a) or '(none)'}" for pod, a in sorted(changed.items()))
            await self.client.event(body, "Normal", "AdapterPlacementChanged", f"adapters now on: {summary}")
        return placement

    async def _write_status(self, body: dict[str, Any], status: dict[str, Any]) -> None:
        if (body.get("status") or {}) == status:
            return
        meta = body["metadata"]
        await self.client.patch(API_VERSION, PLURAL, meta["namespace"], meta["name"], {"status": status}, "status")

    async def _observe_adapters(self, spec: InferenceModelSpec, pods: list[PodView],
                                placement: Placement | None) -> Observed | None:
        if not spec.adapters or placement is None:
            return None
        by_name = {p.name: p for p in pods}
        return await self.engines.observe([by_name[n] for n in sorted(placement.assignment)])

    async def _autoscale(self, body: dict[str, Any], spec: InferenceModelSpec, pods: list[PodView],
                         plan: RolePlan) -> None:
        """Decide from the /scale subresource's replicas and write back with its resourceVersion.

        Whoever else writes spec.replicas meanwhile (kubectl scale, GitOps, an edit) wins: the API
        server answers 409 and the autoscaler decides again from the new value at the next resync.
        """
        meta = body["metadata"]
        path = api_path(API_VERSION, PLURAL, meta["namespace"], meta["name"], "scale")
        scale = await self.client.request("GET", path)
        if (scale.get("spec") or {}).get("replicas") != spec.replicas:
            return  # changed since this pass read the model: that pass's decision would be stale
        by_name = {p.name: p for p in pods}
        serving = [by_name[n] for n in plan.active() if by_name[n].ready]
        depths = await self.metrics.queue_depths(serving)
        idle = False
        if spec.min_replicas == 0 and serving:  # scale to zero only on a full reading of no work anywhere
            activity = await self.metrics.activity(serving)
            idle = len(activity) == len(serving) and not any(activity.values())
        wanted = self.autoscaler.decide(f"{meta['namespace']}/{meta['name']}", spec, list(depths.values()),
                                        time.monotonic(), idle)
        if wanted == spec.replicas:
            return
        average = sum(depths.values()) / max(len(depths), 1)
        try:
            await self.client.patch(API_VERSION, PLURAL, meta["namespace"], meta["name"],
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
        await self.client.event(body, "Normal", "Autoscaled", f"spec.replicas {spec.replicas} -> {wanted}: {why}")
