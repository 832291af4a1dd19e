"""One level-based pass over an InferenceModel: read the world, compute the desired state, write the difference.

Every pass starts from what the API server says now, never from what an earlier pass did, so any
pass can be repeated, interrupted or skipped. Passes for one model never overlap: a trigger that
arrives during a pass makes that pass run once more instead (coalescing bursts of pod events).
A pass that fails on the API is classified (errors.py): retried with backoff, or reported as
Forbidden or InvalidSpec in status, one log line per distinct failure.
This module schedules passes and runs a pass's steps in order (refusals and status are written here); the
steps' writes are in owned_objects.py, pod_assignment.py and autoscale_pass.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from typing import Any

from kubeinfer.operator.autoscale import Autoscaler, HttpQueueDepths, QueueDepthSource
from kubeinfer.operator.autoscale_pass import autoscale_model
from kubeinfer.operator.builders import group_secret
from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.drift import owned_drift
from kubeinfer.operator.errors import FORBIDDEN, INVALID, Failure, backoff_seconds, classify
from kubeinfer.operator.groups import serving_units
from kubeinfer.operator.kube import KubeClient
from kubeinfer.operator.leader_worker import (LWS_API_VERSION, LWS_MISSING, LWS_PLURAL, lws_missing_message,
                                              multi_node)
from kubeinfer.operator.loaded import HttpLoadedAdapters, LoadedAdapterSource
from kubeinfer.operator.model_state import ModelState
from kubeinfer.operator.names import API_VERSION, PLURAL, selector_labels
from kubeinfer.operator.owned_objects import apply_group_policies, apply_owned, retire_other_shape
from kubeinfer.operator.pod_assignment import apply_placement, apply_roles, observe_adapters
from kubeinfer.operator.policy import POLICY_VIOLATION, violations
from kubeinfer.operator.served_names import SERVED_NAME_CONFLICT, conflict_message, rivals
from kubeinfer.operator.spec import SpecError, parse_spec
from kubeinfer.operator.status import build_status, failure_status, invalid_status, now_rfc3339
from kubeinfer.operator.template_hash import current_template

logger = logging.getLogger(__name__)
CRD_CHECK_SECONDS = 60.0
RESYNC_CONCURRENCY = 16
ADAPTER_RECHECK_SECONDS = 5.0  # engines load adapters after the annotation reaches them: look again soon


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
        await apply_owned(self.client, self.config, self._crd_exists, body, spec, state, generation)
        if full and multi_node(spec):
            await apply_group_policies(self.client, self.config, body, spec)
        found = await self.client.list("v1", "pods", namespace, selector_labels(name))
        pods = serving_units(found, spec.engine.parallelism.nodes)
        plan = await apply_roles(self.client, body, spec, pods)
        await retire_other_shape(self.client, self._crd_exists, body, spec, found, pods, full)
        placement = await apply_placement(self.client, body, spec, pods, plan)
        observed = await observe_adapters(self.engines, spec, pods, placement)
        template = current_template(state.desired.get("LeaderWorkerSet" if multi_node(spec) else "Deployment"))
        status = build_status(body, spec, pods, plan, placement, now_rfc3339(), observed, template)
        await self._write_status(body, status)
        placed = next(c for c in status["conditions"] if c["type"] == "AdaptersPlaced")
        if placed["reason"] == "NotLoaded":
            self._later(namespace, name, min(ADAPTER_RECHECK_SECONDS, self.config.resync_seconds))
        if autoscale and spec.autoscaling is not None:
            await autoscale_model(self.client, self.metrics, self.autoscaler, body, spec, pods, plan)

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

    async def _write_status(self, body: dict[str, Any], status: dict[str, Any]) -> None:
        if (body.get("status") or {}) == status:
            return
        meta = body["metadata"]
        await self.client.patch(API_VERSION, PLURAL, meta["namespace"], meta["name"], {"status": status}, "status")
