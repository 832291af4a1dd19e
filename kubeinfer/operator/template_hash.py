"""Which pods run the pod template the operator wants now.

A spec change rolls out a new ReplicaSet (or LeaderWorkerSet revision) while the old one's pods linger; the
status must describe the new pods' trouble, not an old pod that is about to go. The operator stamps a hash of
the templates it renders on each of them (so on every pod made from them); a pod stamped with another hash
comes from an earlier template.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from kubeinfer.operator.names import TEMPLATE_ANNOTATION


def _templates(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload.get("spec") or {}
    if "leaderWorkerTemplate" in spec:
        group = spec["leaderWorkerTemplate"]
        return [group[key] for key in ("leaderTemplate", "workerTemplate") if key in group]
    return [spec["template"]] if "template" in spec else []


def stamp_templates(workload: dict[str, Any]) -> dict[str, Any]:
    """Annotate every pod template of a Deployment or LeaderWorkerSet with one hash of them all."""
    templates = _templates(workload)
    digest = hashlib.sha256(json.dumps(templates, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    for template in templates:
        template.setdefault("metadata", {}).setdefault("annotations", {})[TEMPLATE_ANNOTATION] = digest
    return workload


def current_template(workload: dict[str, Any] | None) -> str | None:
    """The hash stamped on `workload`'s templates (None: not rendered yet)."""
    for template in _templates(workload or {}):
        return ((template.get("metadata") or {}).get("annotations") or {}).get(TEMPLATE_ANNOTATION)
    return None
