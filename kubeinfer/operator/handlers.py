"""kopf registrations: thin handlers that all end in one coalesced, level-based reconcile pass.

Spec changes (create / update / resume) re-apply the owned objects; pod events (a pod became ready,
was deleted, lost readiness) and a periodic resync loop redo roles, placement, status and autoscaling.
Owned objects (Deployment or LeaderWorkerSet, Service, PDB, InferencePool, NetworkPolicy) are watched too: one
deleted or edited by hand is repaired by the pass its event starts, within a second, not at the next resync.
No finalizer: owner references make the garbage collector delete what the operator built.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import kopf

from kubeinfer.operator.drift import controller_of
from kubeinfer.operator.in_cluster import SERVICE_ACCOUNT_DIR, api_server_answers, login_in_cluster
from kubeinfer.operator.leader_worker import LWS_GROUP, LWS_PLURAL, LWS_VERSION
from kubeinfer.operator.names import (GROUP, MANAGED_BY_LABEL, MANAGER, MODEL_LABEL, PLURAL, POOL_GROUP, POOL_PLURAL,
                                      POOL_VERSION, VERSION)
from kubeinfer.operator.reconcile import Reconciler

Connect = Callable[[], Awaitable[kopf.ConnectionInfo]]
RETRY_SECONDS = 10
# What the operator builds, watched by its label; kopf skips a resource whose CRD is not installed.
OWNED = {"Deployment": ("apps", "v1", "deployments"), "Service": ("", "v1", "services"),
         "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
         "InferencePool": (POOL_GROUP, POOL_VERSION, POOL_PLURAL),
         "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
         "LeaderWorkerSet": (LWS_GROUP, LWS_VERSION, LWS_PLURAL)}


async def connect_default() -> kopf.ConnectionInfo:
    """In-cluster service account first (KUBERNETES_SERVICE_HOST/PORT: in_cluster.py), then KUBECONFIG (with exec
    plugins if `kubernetes` is installed)."""
    logger = logging.getLogger("kubeinfer.operator.login")
    attempts: list[Callable[..., Any]] = []
    if os.path.exists(f"{SERVICE_ACCOUNT_DIR}/token"):
        attempts.append(login_in_cluster)
    try:
        import kubernetes  # noqa: F401  (optional: understands every kubeconfig auth method)
        attempts.append(kopf.login_via_client)
    except ImportError:
        pass
    attempts.append(kopf.login_with_kubeconfig)
    settings = kopf.OperatorSettings()  # login only reads its defaults; our client logs in outside kopf too
    failures = []
    for attempt in attempts:
        try:
            info = attempt(logger=logger, settings=settings)
        except Exception as err:  # the next method may still work (e.g. in-cluster, no kubeconfig)
            failures.append(f"{attempt.__name__}: {err}")
            continue
        if info is not None:
            return info
    raise kopf.LoginError("no Kubernetes credentials: run in a cluster with a service account, or set KUBECONFIG "
                          f"({'; '.join(failures) or 'nothing found'})")


def register(registry: kopf.OperatorRegistry, reconciler: Reconciler, connect: Connect = connect_default) -> None:
    """Attach the operator's handlers to `registry` (one per running operator: tests make their own)."""
    model = dict(group=GROUP, version=VERSION, plural=PLURAL, registry=registry)
    interval = reconciler.config.resync_seconds

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.ConnectionInfo:
        return await connect()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Progress lives in annotations: the CRD's structural schema would prune kopf's status fields.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.kubeinfer.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kopf.kubeinfer.io")
        settings.posting.level = logging.WARNING  # Events for problems; promotions are our own Events

    @kopf.on.startup(registry=registry)
    async def start_resync(**_: Any) -> None:
        # One loop over all models instead of a kopf timer per model: kopf timers put a finalizer on
        # every InferenceModel, and deleting one would then hang whenever the operator is down.
        reconciler.start_resync(interval)

    # /healthz (kopf's liveness endpoint) fails while the API server does not answer: a pod that reconciles
    # nothing must not look Ready.
    @kopf.on.probe(registry=registry, id="api-server", errors=kopf.ErrorsMode.PERMANENT)
    async def api_server(**_: Any) -> str:
        return await api_server_answers(reconciler.client)

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        await reconciler.stop_resync()
        await reconciler.client.close()

    @kopf.on.resume(**model, backoff=RETRY_SECONDS)
    @kopf.on.create(**model, backoff=RETRY_SECONDS)
    @kopf.on.update(**model, backoff=RETRY_SECONDS)
    async def spec_changed(namespace: str, name: str, **_: Any) -> None:
        await reconciler.trigger(namespace, name, apply=True)

    # Deletion is seen on the raw watch stream: kopf.on.delete would need a finalizer to be
    # reliable, and nothing needs cleaning up but the operator's own memory of the model.
    @kopf.on.event(**model)
    async def deleted(type: str, namespace: str, name: str, **_: Any) -> None:  # in the loop, not a thread
        if type == "DELETED":
            reconciler.forget(namespace, name)

    @kopf.on.event("", "v1", "pods", labels={MANAGED_BY_LABEL: MANAGER}, registry=registry)
    async def pod_changed(namespace: str, labels: dict[str, str], **_: Any) -> None:
        if labels.get(MODEL_LABEL):
            await reconciler.trigger(namespace, labels[MODEL_LABEL])

    for kind, (group, version, plural) in OWNED.items():
        register_owned(registry, reconciler, kind, group, version, plural)


def register_owned(registry: kopf.OperatorRegistry, reconciler: Reconciler, kind: str, group: str, version: str,
                   plural: str) -> None:
    @kopf.on.event(group, version, plural, labels={MANAGED_BY_LABEL: MANAGER}, registry=registry,
                   id=f"owned-{plural}")
    async def owned_changed(type: str | None, body: kopf.Body, namespace: str, **_: Any) -> None:
        model = controller_of(body)
        if model:
            await reconciler.owned_changed(namespace, model, kind, None if type == "DELETED" else dict(body))
