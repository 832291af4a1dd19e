"""A namespace being deleted refuses new objects with 403: that is its termination, not RBAC (issue #46,
defect 12). The operator says so once, at info level, without asking anyone to grant a permission."""
from __future__ import annotations

import asyncio
import json
import logging

from operator_harness import Cluster, eventually
from test_operator_kmock import SPEC, condition

from kubeinfer.operator.errors import FORBIDDEN, TERMINATING, classify
from kubeinfer.operator.kube import ApiError

# What kube-apiserver answers (NamespaceLifecycle admission) to a create in a namespace being deleted
TERMINATING_STATUS = {
    "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
    "message": 'deployments.apps "m" is forbidden: unable to create new content in namespace ml because it is '
               "being terminated",
    "details": {"name": "m", "group": "apps", "kind": "deployments",
                "causes": [{"reason": "NamespaceTerminating", "message": "namespace ml is being terminated",
                            "field": "metadata.namespace"}]}}
PATH = "/apis/apps/v1/namespaces/ml/deployments/m"


def test_a_terminating_namespace_is_no_missing_permission():
    failure = classify(ApiError(403, "PATCH", PATH, json.dumps(TERMINATING_STATUS)))
    assert failure.reason == TERMINATING and not failure.retry
    assert "namespace ml is being deleted" in failure.message
    assert "ClusterRole" not in failure.message and "grant" not in failure.message
    assert failure.log_level == logging.INFO


def test_the_cause_alone_is_enough_and_other_403s_stay_forbidden():
    only_cause = {**TERMINATING_STATUS, "message": "forbidden"}
    assert classify(ApiError(403, "PATCH", PATH, json.dumps(only_cause))).reason == TERMINATING
    rbac = {**TERMINATING_STATUS, "message": 'User "x" cannot patch resource "deployments"', "details": {}}
    assert classify(ApiError(403, "PATCH", PATH, json.dumps(rbac))).reason == FORBIDDEN


async def test_a_model_in_a_namespace_being_deleted_is_reported_as_such(caplog):
    caplog.set_level(logging.DEBUG, logger="kubeinfer.operator")
    async with Cluster(resync_seconds=0.2) as cluster:
        cluster.k8s.refuse("PATCH", "deployments", 403, TERMINATING_STATUS["message"])
        await cluster.create_model("t1", SPEC)

        async def reported():
            c = condition(await cluster.model("t1"), "Progressing")
            return c.get("reason") == TERMINATING and c
        progressing = await eventually(reported)
        assert progressing["status"] == "False" and "being deleted" in progressing["message"]
        model = await cluster.model("t1")
        assert condition(model, "Degraded").get("reason") != FORBIDDEN
        await asyncio.sleep(1.0)  # several resync passes meet the same refusal
        loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not [m for m in loud if "t1" in m], loud
        assert not [r for r in caplog.records if "grant it" in r.getMessage()]
        assert len([r for r in caplog.records if r.levelno == logging.INFO and "being deleted" in r.getMessage()]) == 1
        assert await cluster.events(FORBIDDEN) == []
