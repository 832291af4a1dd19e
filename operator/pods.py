"""What the operator needs to know about one engine pod, read from the pod object."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubeinfer.operator.names import ADAPTERS_ANNOTATION, ROLE_LABEL

# Waiting reasons after which a container does not start by itself.
STUCK_REASONS = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError",
                 "InvalidImageName", "CreateContainerError")


@dataclass(frozen=True)
class PodView:
    name: str
    role: str | None = None
    ready: bool = False
    deleting: bool = False
    created: str = ""  # RFC 3339 sorts as text
    adapters: tuple[str, ...] = ()
    ip: str | None = None
    unschedulable: str | None = None  # the scheduler's message
    stuck: str | None = None  # "<container>: <reason>: <message>"
    failed: bool = False


def parse_adapters(value: str | None) -> tuple[str, ...]:
    return tuple(name.strip() for name in (value or "").split(",") if name.strip())


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


def _stuck(status: dict[str, Any]) -> str | None:
    for item in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (item.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_REASONS:
            return f"{item.get('name')}: {waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
    return None


def pod_view(pod: dict[str, Any]) -> PodView:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    scheduled = _condition(status, "PodScheduled")
    unschedulable = None
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message") or "Unschedulable"
    return PodView(
        name=meta["name"], role=(meta.get("labels") or {}).get(ROLE_LABEL),
        ready=_condition(status, "Ready").get("status") == "True" and not meta.get("deletionTimestamp"),
        deleting=bool(meta.get("deletionTimestamp")), created=meta.get("creationTimestamp") or "",
        adapters=parse_adapters((meta.get("annotations") or {}).get(ADAPTERS_ANNOTATION)),
        ip=status.get("podIP"), unschedulable=unschedulable, stuck=_stuck(status),
        failed=status.get("phase") in ("Failed", "Succeeded"))
