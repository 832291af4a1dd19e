"""Pure parts of issue #16: error classes, drift detection, observed adapters and their condition."""
from __future__ import annotations

import aiohttp
import pytest

from kubeinfer.operator.drift import controller_of, drift, owned_drift
from kubeinfer.operator.errors import FORBIDDEN, INVALID, RETRYING, backoff_seconds, classify, rbac_request
from kubeinfer.operator.kube import ApiError
from kubeinfer.operator.loaded import Observed, adapters_in
from kubeinfer.operator.placement import place_adapters
from kubeinfer.operator.spec import parse_spec
from kubeinfer.operator.status import adapters_condition, failure_status


# -- error classes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,path,expected", [
    ("PATCH", "/apis/policy/v1/namespaces/ml/poddisruptionbudgets/m", ("patch", "poddisruptionbudgets", "policy", "ml")),
    ("GET", "/api/v1/namespaces/ml/pods", ("list", "pods", "", "ml")),
    ("GET", "/api/v1/namespaces/ml/pods/p", ("get", "pods", "", "ml")),
    ("POST", "/api/v1/namespaces/ml/events", ("create", "events", "", "ml")),
    ("PATCH", "/apis/serving.kubeinfer.io/v1alpha1/namespaces/ml/inferencemodels/m/scale",
     ("patch", "inferencemodels/scale", "serving.kubeinfer.io", "ml")),
    ("GET", "/api/v1/namespaces", ("list", "namespaces", "", None)),
    ("GET", "/apis/apps/v1/deployments", ("list", "deployments", "apps", None)),
])
def test_requests_are_named_as_rbac_names_them(method, path, expected):
    r = rbac_request(method, path)
    assert (r.verb, r.resource, r.group, r.namespace) == expected


def api_error(status: int, message: str = "no") -> ApiError:
    return ApiError(status, "PATCH", "/apis/apps/v1/namespaces/ml/deployments/m", f'{{"message": "{message}"}}')


def test_403_is_forbidden_naming_verb_and_resource():
    failure = classify(api_error(403, "cannot patch resource"))
    assert failure.reason == FORBIDDEN and not failure.retry
    assert "patch deployments (API group 'apps') in namespace ml" in failure.message
    assert "cannot patch resource" in failure.message


@pytest.mark.parametrize("status", [400, 422])
def test_refused_objects_are_invalid_spec_with_the_servers_message(status):
    failure = classify(api_error(status, "spec.x: Invalid value"))
    assert failure.reason == INVALID and "spec.x: Invalid value" in failure.message and not failure.retry


@pytest.mark.parametrize("err", [api_error(409), api_error(404), api_error(429), api_error(500), api_error(503),
                                 TimeoutError(), aiohttp.ClientConnectionError("reset")])
def test_conflicts_server_errors_and_timeouts_are_retried(err):
    failure = classify(err)
    assert failure.reason == RETRYING and failure.retry


def test_bugs_are_not_classified():
    assert classify(KeyError("spec")) is None


def test_backoff_doubles_up_to_a_ceiling():
    assert [backoff_seconds(n) for n in range(4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff_seconds(50) == 30.0


def test_failure_status_keeps_ready_and_other_conditions():
    previous = [{"type": "Ready", "status": "True", "reason": "Serving", "message": "ok", "lastTransitionTime": "T0"},
                {"type": "AdaptersPlaced", "status": "True", "reason": "Placed", "message": "",
                 "lastTransitionTime": "T0"}]
    body = {"metadata": {"generation": 2}, "status": {"replicas": 2, "conditions": previous}}
    status = failure_status(classify(api_error(403)), body, "T1")
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Degraded"]["reason"] == "Forbidden" and conds["Degraded"]["status"] == "True"
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["lastTransitionTime"] == "T0"
    assert conds["AdaptersPlaced"]["reason"] == "Placed" and status["replicas"] == 2


# -- drift ---------------------------------------------------------------------------------------------
OWNED = {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "m", "labels": {"a": "1"}, "ownerReferences": [{"kind": "InferenceModel", "name": "m",
                                                                               "controller": True}]},
         "spec": {"selector": {"role": "active"}, "ports": [{"name": "http", "port": 8000}]}}


def test_fields_others_add_are_not_drift():
    observed = {**OWNED, "metadata": {**OWNED["metadata"], "annotations": {"x": "y"}, "resourceVersion": "9"},
                "spec": {**OWNED["spec"], "clusterIP": "10.0.0.1",
                         "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}]},
                "status": {"loadBalancer": {}}}
    assert owned_drift(OWNED, observed) == []


def test_changed_missing_or_deleted_fields_are_drift():
    edited = {**OWNED, "spec": {"selector": {"role": "standby"}, "ports": OWNED["spec"]["ports"]}}
    assert owned_drift(OWNED, edited) == ["spec.selector.role"]
    assert owned_drift(OWNED, {**OWNED, "spec": {"selector": {"role": "active"}, "ports": []}}) == ["spec.ports"]
    assert owned_drift(OWNED, None) == ["(deleted)"]
    assert owned_drift(OWNED, {**OWNED, "metadata": {**OWNED["metadata"], "deletionTimestamp": "T"}})
    assert drift({"a": [1, {"b": 2}]}, {"a": [1, {"b": 3}]}) == ["a[1].b"]


def test_controller_reference_names_the_model():
    assert controller_of(OWNED) == "m"
    assert controller_of({"metadata": {"ownerReferences": [{"kind": "ReplicaSet", "name": "x", "controller": True}]}}) \
        is None


# -- observed adapters ---------------------------------------------------------------------------------
def test_adapters_are_the_cards_with_a_parent():
    models = {"object": "list", "data": [{"id": "base", "parent": None}, {"id": "sql", "parent": "base"},
                                         {"id": "chat", "parent": "base"}]}
    assert adapters_in(models) == ("chat", "sql")
    assert adapters_in({}) == ()


SPEC = parse_spec("m", {"model": {"uri": "pvc://m/x"}, "replicas": 2,
                        "adapters": [{"name": n, "uri": f"pvc://l/{n}"} for n in "ab"],
                        "adapterPool": {"maxLorasPerReplica": 2, "replicasPerAdapter": 2}})
PLACEMENT = place_adapters(["a", "b"], ["p1", "p2"], {}, 2, 2)


def test_placed_only_when_every_assigned_pod_serves_the_adapter():
    all_loaded = Observed({"p1": ("a", "b"), "p2": ("a", "b")})
    assert adapters_condition(SPEC, PLACEMENT, all_loaded).status is True
    one_failed = adapters_condition(SPEC, PLACEMENT, Observed({"p1": ("a", "b"), "p2": ("a",)}))
    assert (one_failed.status, one_failed.reason) == (False, "NotLoaded") and "b on p2" in one_failed.message
    unknown = adapters_condition(SPEC, PLACEMENT, Observed({"p1": ("a", "b")}, {"p2": "ConnectTimeout"}))
    assert (unknown.status, unknown.reason) == (False, "Unobserved") and "ConnectTimeout" in unknown.message
    assert adapters_condition(SPEC, PLACEMENT, None).status is False  # not observed is not placed


# -- issue #44 finding 8: a termination message reaches the conditions without terminal controls -------------
def test_a_termination_message_loses_its_terminal_controls_but_keeps_its_lines():
    from kubeinfer.operator.pods import last_words

    said = "kubeinfer serve: bad\x1b]0;owned\x07\x1b[2J\r\nsecond\tline\x08\x9b\u202egnp.exe\x00"
    words = last_words({"lastState": {"terminated": {"exitCode": 1, "message": said}}})
    assert words == "exit code 1: kubeinfer serve: bad\nsecond\tlinegnp.exe"  # escape sequences gone whole
    assert not any(ord(c) < 32 and c not in "\n\t" or 0x7f <= ord(c) < 0xa0 for c in words)


def test_a_long_termination_message_keeps_its_1000_character_excerpt():
    from kubeinfer.operator.pods import MESSAGE_HEAD, MESSAGE_TAIL, last_words

    said = "\x1b[31m" * 10_000 + "first " + "x" * 100_000 + " the point"
    words = last_words({"state": {"terminated": {"exitCode": 2, "message": said}}})
    assert words.startswith("exit code 2: first ") and words.endswith(" the point") and "\x1b" not in words
    assert len(words) <= len("exit code 2: ") + MESSAGE_HEAD + MESSAGE_TAIL + 5
