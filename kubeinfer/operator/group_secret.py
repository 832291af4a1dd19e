"""The shared secret of a multi-node model's tensor-parallel groups (the engine's KUBEINFER_TP_SECRET): a
Secret per model, made once by the operator with a random value, owned by the InferenceModel (it goes with
it), and never rewritten: a changed value would split running groups from the pods restarting beside them.

The operator only creates it (RBAC `create` on secrets, no `get`): an existing Secret of that name is kept as
it is (409), so a user may also bring their own, with the same key. Every pod of every group (leader and
workers) reads it through a secretKeyRef; a rank without it cannot join its group
(kubeinfer/engine/distributed/group_auth.py)."""
from __future__ import annotations

import base64
import secrets
from typing import Any

from kubeinfer.operator.owned_args import TP_SECRET_ENV  # the engine's group_auth.SECRET_ENV; refused in env

TP_SECRET_KEY = "secret"


def tp_secret_name(model: str) -> str:
    return f"{model}-tp-secret"


def tp_secret(metadata: dict[str, Any]) -> dict[str, Any]:
    """A new Secret for the model whose owned objects carry `metadata` (its labels and owner reference)."""
    value = secrets.token_hex(32).encode()  # 64 characters: above the engine's minimum of 32
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {**metadata, "name": tp_secret_name(metadata["name"])},
            "data": {TP_SECRET_KEY: base64.b64encode(value).decode()}}


def tp_secret_env(model: str) -> list[dict[str, Any]]:
    return [{"name": TP_SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": tp_secret_name(model),
                                                                   "key": TP_SECRET_KEY}}}]
