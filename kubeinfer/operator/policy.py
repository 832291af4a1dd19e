"""Operator-level policy on what an InferenceModel may ask of the node: host paths, image, scheduling.

A namespace user who may create InferenceModels must not get more than the cluster admin allowed the
operator to hand out: the operator builds the pods, so Pod Security admission in the model's
namespace is the only other check. Each rule names the field it refuses; a model that breaks one gets
`Ready=False, reason=PolicyViolation` and nothing is built for it.

- `file://` (a hostPath volume) only under a prefix the operator was started with (`--allow-host-path`),
  never under the node's own state (kubelet, container runtime, /etc, /proc ...), even if a prefix covers it.
- `spec.engine.image` only from allowed prefixes (`--allowed-image-prefix`; default: the repository of
  `--engine-image`), matched at a path boundary so `.../engine` does not admit `.../engine-evil`.
- `spec.engine.priorityClassName`: only the listed classes (`--allowed-priority-class`); with none
  listed, any class except the built-in `system-*` ones, which outrank every workload on the node.
- Tolerations with `operator: Exists` and no key tolerate every taint (`--allow-wildcard-tolerations`);
  nodeSelectors and tolerations naming control-plane node roles (`--allow-control-plane`).
"""
from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kubeinfer.operator.spec import InferenceModelSpec

# Never a model directory: the node's credentials, the kubelet's and runtimes' state, kernel interfaces.
DENIED_HOST_PATHS = ("/etc", "/proc", "/sys", "/dev", "/boot", "/root", "/run", "/var/run", "/var/lib/kubelet",
                     "/var/lib/containerd", "/var/lib/docker", "/var/lib/cri-o", "/var/log")
CONTROL_PLANE_KEYS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
SYSTEM_PRIORITY_PREFIX = "system-"
POLICY_VIOLATION = "PolicyViolation"


class PolicyError(ValueError):
    """The operator's own policy flags are unusable (raised at start-up, not per model)."""


def under(path: str, prefix: str) -> bool:
    prefix = prefix.rstrip("/") or "/"
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def check_host_prefix(prefix: str) -> str:
    """A normalized --allow-host-path, or PolicyError: absolute, no '..', not / nor a denied directory."""
    if not prefix.startswith("/") or ".." in prefix.split("/"):
        raise PolicyError(f"--allow-host-path {prefix!r} must be an absolute path without '..'")
    clean = posixpath.normpath(prefix)
    if clean == "/" or any(under(clean, denied) or under(denied, clean) for denied in DENIED_HOST_PATHS):
        raise PolicyError(f"--allow-host-path {prefix!r} would cover the node's own state "
                          f"({', '.join(DENIED_HOST_PATHS)}): name the directory holding the models")
    return clean


def image_repository(image: str) -> str:
    """`registry/repo:tag@sha256:...` -> `registry/repo`."""
    name = image.split("@", 1)[0]
    colon = name.rfind(":")
    return name[:colon] if colon > name.rfind("/") else name


def image_allowed(image: str, prefix: str) -> bool:
    """At a path boundary: `ghcr.io/kubeinfer/engine` admits `ghcr.io/kubeinfer/engine:1.0` only."""
    if prefix.endswith("/"):
        return image.startswith(prefix)
    return image == prefix or (image.startswith(prefix) and image[len(prefix)] in ":@/")


@dataclass(frozen=True)
class PodPolicy:
    host_path_prefixes: tuple[str, ...] = ()  # empty: file:// is refused
    image_prefixes: tuple[str, ...] = ()  # empty: the repository of the operator's --engine-image
    priority_classes: tuple[str, ...] = ()  # empty: any but system-*
    allow_wildcard_tolerations: bool = False
    allow_control_plane: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "host_path_prefixes", tuple(check_host_prefix(p) for p in self.host_path_prefixes))


def _host_path(where: str, path: str, policy: PodPolicy) -> str | None:
    if not policy.host_path_prefixes:
        return (f"{where} file://{path} is a hostPath volume, and the operator allows none (a cluster admin "
                "enables file:// with --allow-host-path PREFIX, chart value operator.policy.hostPathPrefixes)")
    denied = next((d for d in DENIED_HOST_PATHS if under(path, d)), None)
    if denied:
        return f"{where} file://{path} is under {denied}, the node's own state: never mounted"
    if not any(under(path, prefix) for prefix in policy.host_path_prefixes):
        return f"{where} file://{path} is not under an allowed host path ({', '.join(policy.host_path_prefixes)})"
    return None


def _tolerations(tolerations: Sequence[dict[str, Any]], policy: PodPolicy) -> list[str]:
    problems = []
    for i, tol in enumerate(tolerations):
        key = tol.get("key") or ""
        if not key and tol.get("operator") == "Exists" and not policy.allow_wildcard_tolerations:
            problems.append(f"spec.engine.tolerations[{i}] (operator: Exists without a key) tolerates every taint, "
                            "control-plane and NoExecute ones included: name the taint's key")
        if key in CONTROL_PLANE_KEYS and not policy.allow_control_plane:
            problems.append(f"spec.engine.tolerations[{i}] tolerates {key}: engines do not run on control-plane nodes")
    return problems


def violations(spec: InferenceModelSpec, policy: PodPolicy, engine_image: str) -> list[str]:
    """Every way `spec` breaks the operator's policy, each naming its field; [] when it may be built."""
    problems: list[str] = []
    sources = [("spec.model.uri", spec.model)] + [(f"spec.adapters[{i}].uri", a.source)
                                                  for i, a in enumerate(spec.adapters)]
    for where, source in sources:
        if source.scheme == "file" and (problem := _host_path(where, source.location, policy)):
            problems.append(problem)
    image = spec.engine.image
    prefixes = policy.image_prefixes or (image_repository(engine_image),)
    if image and not any(image_allowed(image, prefix) for prefix in prefixes):
        problems.append(f"spec.engine.image {image!r} is not from an allowed registry or repository "
                        f"({', '.join(prefixes)}; chart value operator.policy.allowedImagePrefixes)")
    priority = spec.engine.priority_class_name
    if priority and (priority not in policy.priority_classes if policy.priority_classes
                     else priority.startswith(SYSTEM_PRIORITY_PREFIX)):
        allowed = ", ".join(policy.priority_classes) or f"any but {SYSTEM_PRIORITY_PREFIX}*"
        problems.append(f"spec.engine.priorityClassName {priority!r} is not allowed ({allowed}; chart value "
                        "operator.policy.allowedPriorityClasses)")
    problems += _tolerations(spec.engine.tolerations, policy)
    for key in sorted(spec.engine.node_selector):
        if key in CONTROL_PLANE_KEYS and not policy.allow_control_plane:
            problems.append(f"spec.engine.nodeSelector {key} targets control-plane nodes: engines do not run there")
    return problems
