"""One servedName, one model per namespace: the older InferenceModel keeps it.

Clients pick a model by its served name (spec.model.servedName, default metadata.name); two models
claiming one name in a namespace would split or shed each other's traffic at the gateway. The
older claim wins (creationTimestamp, then name: the API server always sets the timestamp, emulators
may not, and an object without one counts as oldest); the newer model gets
`Ready=False, reason=ServedNameConflict` and nothing is built for it until one of them changes.
A claim counts while the model exists and is not being deleted, whether or not it serves yet.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kubeinfer.common.inference_model import read_inference_model

SERVED_NAME_CONFLICT = "ServedNameConflict"


def served_name(body: dict[str, Any]) -> str:
    """spec.model.servedName, else metadata.name: as the gateway routes it (the one InferenceModel reading)."""
    return read_inference_model(body)[0].served_name


def age_key(body: dict[str, Any]) -> tuple[str, str]:
    meta = body["metadata"]
    return meta.get("creationTimestamp") or "", meta["name"]


def rivals(body: dict[str, Any], models: Iterable[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(older, newer): names of the other live models in `models` claiming `body`'s served name."""
    mine, me = served_name(body), age_key(body)
    claims = [m for m in models if m["metadata"]["name"] != body["metadata"]["name"]
              and not m["metadata"].get("deletionTimestamp") and served_name(m) == mine]
    older = sorted((m for m in claims if age_key(m) < me), key=age_key)
    newer = sorted((m for m in claims if age_key(m) > me), key=age_key)
    return [m["metadata"]["name"] for m in older], [m["metadata"]["name"] for m in newer]


def conflict_message(body: dict[str, Any], older: list[str]) -> str:
    return (f"servedName {served_name(body)!r} is already claimed by InferenceModel {older[0]} in this namespace "
            "(the older model keeps it): choose another spec.model.servedName, or delete the other model")
