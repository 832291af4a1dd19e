"""Shared by the tensor-parallel / multi-node operator tests: the engine's parser, the LeaderWorkerSet CRD's
schema, and the LeaderWorkerSet controller played against kmock (it creates each group's pods as the real
controller and its webhook do: names, labels, the LWS_* environment)."""
from __future__ import annotations

import argparse
import functools
import uuid
from pathlib import Path
from typing import Any

import kmock

import crd_schema
from kubeinfer.operator.leader_worker import (GROUP_INDEX_LABEL, LWS_API_VERSION, LWS_PLURAL, SET_NAME_LABEL,
                                              WORKER_INDEX_LABEL, lws_name)

LWS_CRD = Path(__file__).resolve().parents[2] / "shared" / "ref" / "leaderworkersets.x-k8s.io.yaml"
LWS_RESOURCE = {f"{LWS_API_VERSION}/{LWS_PLURAL}": kmock.ResourceInfo(
    kind="LeaderWorkerSet", namespaced=True, verbs={"create", "get", "list", "watch", "patch", "delete"},
    subresources={"status", "scale"})}

def serve_parser(allow_abbrev: bool = True) -> argparse.ArgumentParser:
    from kubeinfer.engine.entrypoints.serve import add_serve_arguments

    parser = argparse.ArgumentParser(allow_abbrev=allow_abbrev, exit_on_error=False)
    add_serve_arguments(parser)
    return parser


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """The kubelet's $(VAR) expansion of a container's args from its environment."""
    out = []
    for arg in args:
        for name, value in env.items():
            arg = arg.replace(f"$({name})", value)
        out.append(arg)
    return out


@functools.lru_cache(maxsize=1)
def lws_schema() -> dict[str, Any]:
    return crd_schema.version_schema(crd_schema.load_crd(LWS_CRD), "v1")


def lws_problems(obj: dict[str, Any]) -> list[str]:
    """What the API server would refuse in a LeaderWorkerSet: its CRD's schema (strict) and CEL rules."""
    import jsonschema

    schema = lws_schema()
    validator = jsonschema.Draft202012Validator(crd_schema.json_schema(schema))
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]
    return errors + crd_schema.cel_violations(schema, crd_schema.apply_defaults(schema, obj))


def group_pods(lws: dict[str, Any], namespace: str, stamp) -> list[dict[str, Any]]:
    """The pods the LeaderWorkerSet controller runs for `lws`: leader NAME-G, workers NAME-G-W."""
    name, spec = lws["metadata"]["name"], lws["spec"]
    size = spec["leaderWorkerTemplate"]["size"]
    pods = []
    for group in range(spec["replicas"]):
        leader = f"{name}-{group}"
        for worker in range(size):
            template = spec["leaderWorkerTemplate"]["leaderTemplate" if worker == 0 else "workerTemplate"]
            labels = {**template["metadata"]["labels"], SET_NAME_LABEL: name, GROUP_INDEX_LABEL: str(group),
                      WORKER_INDEX_LABEL: str(worker)}
            env = [{"name": "LWS_LEADER_ADDRESS", "value": f"{leader}.{name}.{namespace}"},
                   {"name": "LWS_GROUP_SIZE", "value": str(size)}, {"name": "LWS_WORKER_INDEX", "value": str(worker)}]
            pod_spec = {**template["spec"], "containers": [{**c, "env": [*c.get("env", []), *env]}
                                                            for c in template["spec"]["containers"]]}
            pods.append({"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": leader if worker == 0 else f"{leader}-{worker}", "namespace": namespace,
                                      "uid": str(uuid.uuid4()), "creationTimestamp": stamp(), "labels": labels,
                                      "annotations": dict(template["metadata"].get("annotations") or {})},
                         "spec": pod_spec, "status": {"phase": "Pending"}})
    return pods


__all__ = ["LWS_RESOURCE", "expand", "group_pods", "lws_name", "lws_problems", "serve_parser"]
