"""Decoding the engines' KV-event batches, in both encodings vLLM has used.

A message is `[topic, 8-byte big-endian sequence number, msgpack payload]`; the payload an EventBatch
`(ts, events, data_parallel_rank)`. vLLM first sent msgspec's `array_like` structs: a batch as
`[ts, events, rank]`, each event `[tag, ...fields in declared order]`. In 2026 it moved to maps keyed by
field name, the tag under `"type"` (`{"ts":..., "events": [{"type": "BlockStored", "block_hashes": ...}]}`).
Both are read here, so engines of either age (and ours, which sends arrays) can be followed. Fields
appended later (with defaults) are tolerated in either form; a missing required field is an error.
Block hashes may be bytes (ours, vLLM's sha256 keys) or integers (vLLM's older builtin hash): both are
kept as given, they are only compared with themselves.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgpack

# Field order of each event's array form: the wire contract (only ever appended to).
FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}  # leading fields with no default
DEVICE = "GPU"  # vLLM's name for the device tier; a missing medium means it


class WireError(ValueError):
    """A payload that is not an EventBatch in either encoding."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list
    parent_block_hash: object
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str = DEVICE
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list
    medium: str = DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KINDS = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class Batch:
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


def decode_batch(payload: bytes) -> Batch:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as error:
        raise WireError(f"not msgpack: {error}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise WireError(f"an EventBatch is an array or a map, got {type(raw).__name__}")
    if not isinstance(events, list):
        raise WireError("EventBatch.events is not a list")
    return Batch(float(ts or 0.0), [decode_event(e) for e in events], rank)


def decode_event(raw) -> Event:
    if isinstance(raw, dict):
        tag = raw.get("type")
        values = {k: v for k, v in raw.items() if k != "type"}
    elif isinstance(raw, list) and raw:
        tag, *items = raw
        values = dict(zip(FIELDS.get(tag, ()), items))
    else:
        raise WireError(f"an event is an array or a map, got {raw!r:.60}")
    if tag not in KINDS:
        raise WireError(f"unknown event type {tag!r}")
    names = FIELDS[tag]
    missing = [n for n in names[:REQUIRED[tag]] if n not in values]
    if missing:
        raise WireError(f"{tag} lacks {missing}")
    known = {n: values[n] for n in names if n in values}
    if known.get("medium") is None and "medium" in names:
        known["medium"] = DEVICE
    return KINDS[tag](**known)
