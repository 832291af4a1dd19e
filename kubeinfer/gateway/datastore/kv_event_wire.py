"""Decoding the engines' KV-event batches, in both encodings vLLM has used.

A message is `[topic, 8-byte big-endian sequence number, msgpack payload]`; the payload an EventBatch
`(ts, events, data_parallel_rank)`. vLLM first sent msgspec's `array_like` structs: a batch as
`[ts, events, rank]`, each event `[tag, ...fields in declared order]`. In 2026 it moved to maps keyed by
field name, the tag under `"type"` (`{"ts":..., "events": [{"type": "BlockStored", "block_hashes": ...}]}`).
Both are read here, so engines of either age (and ours, which sends arrays) can be followed. Fields
appended later (with defaults) are tolerated in either form; a missing required field is an error.
Block hashes may be bytes (ours, vLLM's sha256 keys) or integers (vLLM's older builtin hash): both are
kept as given, they are only compared with themselves.

Every field is checked before it reaches the index (an engine, or whatever answers at its address, writes
them): types, a block size in 1..MAX_BLOCK_SIZE with exactly block_size token ids per block hash, token ids
and integer hashes in 64 bits, bounded hash and name lengths. Anything else is a WireError, and the
subscriber sets that one pod aside.
"""
from __future__ import annotations

from array import array
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
MAX_BLOCK_SIZE = 16384  # tokens per block: vLLM's are 1..256, hybrid models' a few hundred more
MAX_HASH_BYTES = 64  # sha256 keys are 32
MAX_NAME_CHARS = 256  # medium, lora_name
MIN_INT, MAX_INT = -(1 << 63), (1 << 64) - 1  # an integer hash: signed (Python's hash) or unsigned 64-bit


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
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        raise WireError("EventBatch.ts is not a number")
    if not isinstance(events, list):
        raise WireError("EventBatch.events is not a list")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise WireError("EventBatch.data_parallel_rank is not an integer")
    return Batch(float(ts or 0.0), [decode_event(e) for e in events], rank)


def decode_event(raw) -> Event:
    if isinstance(raw, dict):
        tag = raw.get("type")
        values = {k: v for k, v in raw.items() if k != "type"}
    elif isinstance(raw, list) and raw:
        tag, *items = raw
        values = dict(zip(FIELDS.get(tag, ()) if isinstance(tag, str) else (), items))
    else:
        raise WireError(f"an event is an array or a map, got {type(raw).__name__}")
    if not isinstance(tag, str) or tag not in KINDS:
        raise WireError(f"unknown event type {str(tag)[:40]!r}")
    names = FIELDS[tag]
    missing = [n for n in names[:REQUIRED[tag]] if n not in values]
    if missing:
        raise WireError(f"{tag} lacks {missing}")
    known = {n: values[n] for n in names if n in values}
    if known.get("medium") is None and "medium" in names:
        known["medium"] = DEVICE
    _check(tag, known)
    return KINDS[tag](**known)


def _check(tag: str, fields: dict) -> None:
    """WireError naming the first field of this event that is not what the wire contract says."""
    if "block_hashes" in fields:
        hashes = fields["block_hashes"]
        if not isinstance(hashes, list) or not all(_is_hash(h) for h in hashes):
            raise WireError(f"{tag}.block_hashes is not a list of hashes (bytes, or 64-bit integers)")
    if _too_long_name(fields.get("medium")):
        raise WireError(f"{tag}.medium is not a string of at most {MAX_NAME_CHARS} characters")
    if tag != "BlockStored":
        return
    if not fields["block_hashes"]:
        raise WireError("BlockStored.block_hashes is empty")
    parent = fields["parent_block_hash"]
    if parent is not None and not _is_hash(parent):
        raise WireError("BlockStored.parent_block_hash is not a hash")
    size = fields["block_size"]
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_BLOCK_SIZE:
        raise WireError(f"BlockStored.block_size {str(size)[:20]} is not in 1..{MAX_BLOCK_SIZE}")
    tokens = fields["token_ids"]
    if not isinstance(tokens, list) or len(tokens) != size * len(fields["block_hashes"]):
        raise WireError("BlockStored.token_ids is not block_size token ids per block hash")
    try:  # in C: int64s (as the index packs them: a float, a string or a larger number raises), none negative
        packed = array("q", tokens)
    except (TypeError, OverflowError):
        packed = None
    if packed is None or (tokens and min(tokens) < 0):
        raise WireError("BlockStored.token_ids holds something other than token ids")
    lora_id = fields.get("lora_id")
    if lora_id is not None and (type(lora_id) is not int or not MIN_INT <= lora_id <= MAX_INT):
        raise WireError("BlockStored.lora_id is not an integer")
    if _too_long_name(fields.get("lora_name")):
        raise WireError(f"BlockStored.lora_name is not a string of at most {MAX_NAME_CHARS} characters")


def _is_hash(value) -> bool:
    if isinstance(value, bytes):
        return 0 < len(value) <= MAX_HASH_BYTES
    return type(value) is int and MIN_INT <= value <= MAX_INT


def _too_long_name(value) -> bool:
    return value is not None and (not isinstance(value, str) or len(value) > MAX_NAME_CHARS)
