"""The key the gateway presents to engines (`--engine-api-key`, env KUBEINFER_ENGINE_API_KEY).

Engines take their API only with a key (`kubeinfer serve --api-key`, env KUBEINFER_API_KEY): the
gateway is the one door, and a pod elsewhere in the cluster that reaches an engine directly gets a
401. The gateway presents the key as `Authorization: Bearer KEY` on all it sends to engines:
forwarded requests (in place of the client's own Authorization, which carries a tenant's key and is
the gateway's business only), the /load and /v1/models polls, and, in ext_proc mode, as a header
mutation Envoy applies before it dials the engine. Without a key the client's header passes as sent.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping


def engine_authorization(key: str | None) -> dict[str, str]:
    """The header that carries the engine key; empty without one."""
    return {"authorization": f"Bearer {key}"} if key else {}


def for_engine(headers: Mapping[str, str], key: str | None, drop: Collection[str] = ()) -> dict[str, str]:
    """Headers to forward, less those named in `drop` (lower case): the client's Authorization replaced by
    the engine key, when there is one."""
    drop = {*drop, "authorization"} if key else set(drop)
    return {**{k: v for k, v in headers.items() if k.lower() not in drop}, **engine_authorization(key)}


def without_paths(card: dict) -> dict:
    """A model card as clients see it: an engine's `root` is a directory on its pod (where the model or
    adapter was read from); the gateway shows the served name in its place."""
    return {**card, "root": card.get("id")} if "root" in card else card
