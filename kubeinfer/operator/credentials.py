"""Which container sees which credential: fetch credentials only where they fetch.

spec.engine.env is one list for the whole pod, but a Hugging Face token or AWS keys are needed only by
the init container that downloads the model or adapters; in the serving container (which runs with
HF_HUB_OFFLINE=1 and never talks to S3) they would be one exploit away from a client. So:
- the engine container gets spec.engine.env without them (and the API key the operator sets);
- the `hf download` container gets it without the AWS ones, `aws s3 sync` without the Hugging Face ones.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

HF_CREDENTIALS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
AWS_PREFIX = "AWS_"


def _is_hf(item: dict[str, Any]) -> bool:
    return item.get("name") in HF_CREDENTIALS


def _is_aws(item: dict[str, Any]) -> bool:
    return str(item.get("name", "")).startswith(AWS_PREFIX)


def serving_env(env: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """spec.engine.env for the engine container: no fetch credentials."""
    return [item for item in env if not (_is_hf(item) or _is_aws(item))]


def fetch_env(scheme: str, env: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """spec.engine.env for the init container fetching `scheme` (hf or s3): its own credentials only."""
    other = _is_aws if scheme == "hf" else _is_hf
    return [item for item in env if not other(item)]
