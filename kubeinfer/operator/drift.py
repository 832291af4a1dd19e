"""Has an owned object drifted from what the operator would apply? Decided without a write.

Owned objects are watched: every change to a Deployment, Service, PodDisruptionBudget or
InferencePool the operator built arrives as an event. Re-applying on every event would write on
every status update (and, against an API server that bumps resourceVersion on no-op patches, loop
on our own writes), so the desired object is compared with the observed one first: every field we
set must be there with our value. Fields others set (defaults, a controller's status, a
`kubectl rollout restart` annotation) are not drift: server-side apply would keep them too.
A false positive (e.g. a quantity the server rewrote as "0.5" for our "500m") costs one apply that
changes nothing; on a real API server that produces no watch event, so it cannot loop.
"""
from __future__ import annotations

from typing import Any

from kubeinfer.operator.names import KIND


def drift(desired: Any, observed: Any, path: str = "") -> list[str]:
    """Paths where `observed` lacks or contradicts a field of `desired` (empty: nothing to repair)."""
    if isinstance(desired, dict):
        if not isinstance(observed, dict):
            return [path or "(object missing)"]
        out: list[str] = []
        for key, value in desired.items():
            out += drift(value, observed.get(key), f"{path}.{key}" if path else key)
        return out
    if isinstance(desired, list):
        if not isinstance(observed, list) or len(observed) != len(desired):
            return [path]
        return [p for i, (d, o) in enumerate(zip(desired, observed)) for p in drift(d, o, f"{path}[{i}]")]
    return [] if desired == observed else [path]


def owned_drift(desired: dict[str, Any], observed: dict[str, Any] | None) -> list[str]:
    """What to repair in one owned object: its labels, owner reference and spec (status is not ours)."""
    if observed is None:
        return ["(deleted)"]
    if (observed.get("metadata") or {}).get("deletionTimestamp"):
        return ["(being deleted)"]
    wanted = {"metadata": {k: desired["metadata"][k] for k in ("labels", "ownerReferences")},
              "spec": desired.get("spec")}
    return drift(wanted, observed)


def controller_of(obj: dict[str, Any]) -> str | None:
    """The InferenceModel that controls `obj`, by its controller owner reference."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("controller"):
            return ref.get("name")
    return None
