"""The tensor-parallel channel's message codec: a fixed, versioned schema instead of pickle, so that bytes from
the network are only ever data.

A message is one version byte (VERSION, checked on receive) and a msgpack document made of plain values
(None, bool, int, float, str, bytes, lists, tuples, dicts with str keys), torch tensors (a dtype from
TENSOR_DTYPES, a shape, the raw bytes) and the few dataclasses registered here by name (`register`), whose
fields are checked by name on both sides. Anything else raises WireError when encoded and when decoded (a
non-str dict key inside a list only when decoded: `_check_keys`).
msgpack walks the message in C (exact types only); Python sees only tuples, tensors and records, so a step's
lists of token ids, slots and block tables cost what msgpack costs. bytearray and memoryview travel as bytes."""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import msgpack
import torch

VERSION = 1
MAX_DEPTH = 32  # nested tuples / tensors / records on receive (a step is 3 deep); msgpack bounds the rest
MAX_TENSOR_DIMS = 8
TENSOR_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)}
_DTYPE_NAMES = {dtype: name for name, dtype in TENSOR_DTYPES.items()}
_TUPLE, _TENSOR, _RECORD = 1, 2, 3  # msgpack ext type codes


class WireError(ValueError):
    """A message outside the schema (or of another version); nothing of it was used."""


@dataclasses.dataclass(frozen=True)
class _Record:
    name: str
    cls: type
    fields: frozenset[str]
    to_fields: Callable[[Any], dict[str, Any]]
    from_fields: Callable[[dict[str, Any]], Any]


_BY_NAME: dict[str, _Record] = {}
_BY_TYPE: dict[type, _Record] = {}


def register(cls: type, *, fields: tuple[str, ...] | None = None,
             to_fields: Callable[[Any], dict[str, Any]] | None = None,
             from_fields: Callable[[dict[str, Any]], Any] | None = None) -> type:
    """Let instances of dataclass `cls` travel, by its name. By default every field travels and the receiver
    builds `cls(**fields)` (its __post_init__ checks run); `fields`, `to_fields` and `from_fields` choose
    another layout (the receiver still gets exactly `fields`)."""
    names = frozenset(fields or (f.name for f in dataclasses.fields(cls)))
    record = _Record(cls.__name__, cls, names,
                     to_fields or (lambda obj: {name: getattr(obj, name) for name in names}),
                     from_fields or (lambda values: cls(**values)))
    _BY_NAME[record.name] = _BY_TYPE[cls] = record
    return cls


def encode(message: Any) -> bytes:
    if type(message) is dict:
        _check_keys(message)
    try:
        return bytes((VERSION,)) + _packb(message)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as error:
        raise WireError(f"cannot encode the message: {error}") from None


def decode(data: bytes | bytearray | memoryview) -> Any:
    view = memoryview(data)
    if not view.nbytes or view[0] != VERSION:
        got = view[0] if view.nbytes else "nothing"
        raise WireError(f"message version {got}, expected {VERSION}: rank 0 and this rank run different releases")
    try:
        return _unpackb(view[1:], 0)
    except WireError:
        raise
    except Exception as error:  # msgpack's format errors, RecursionError, a record's own checks...
        raise WireError(f"malformed message: {type(error).__name__}: {error}") from None


def _packb(value: Any) -> bytes:
    """msgpack packs the plain values in C; strict_types (exact types only) sends a subclass, a tuple, a tensor
    or any other object to `_to_ext`, which refuses what the schema does not hold."""
    return msgpack.packb(value, use_bin_type=True, strict_types=True, default=_to_ext)


def _to_ext(obj: Any) -> msgpack.ExtType:
    kind = type(obj)
    if kind is tuple:
        for item in obj:
            if type(item) is dict:
                _check_keys(item)
        return msgpack.ExtType(_TUPLE, _packb(list(obj)))
    if isinstance(obj, torch.Tensor):
        return msgpack.ExtType(_TENSOR, _packb(_tensor_fields(obj)))
    record = _BY_TYPE.get(kind)
    if record is not None:
        fields = record.to_fields(obj)
        _check_keys(fields)
        return msgpack.ExtType(_RECORD, _packb([record.name, fields]))
    raise WireError(f"a {kind.__module__}.{kind.__qualname__} cannot travel on the tensor-parallel channel")


def _check_keys(mapping: dict) -> None:
    """str keys in `mapping` and in the dicts it holds directly. msgpack would pack any key; a dict inside a list
    is not looked into here (that would walk every list in Python), and its receiver refuses a non-str key."""
    for key, value in mapping.items():
        if type(key) is not str:
            raise WireError(f"dict keys must be str, got {type(key).__name__}")
        if type(value) is dict:
            _check_keys(value)


def _tensor_fields(tensor: torch.Tensor) -> list:
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise WireError(f"tensor dtype {tensor.dtype} cannot travel (allowed: {', '.join(TENSOR_DTYPES)})")
    if tensor.dim() > MAX_TENSOR_DIMS:
        raise WireError(f"tensor of {tensor.dim()} dimensions (at most {MAX_TENSOR_DIMS})")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return [name, list(tensor.shape), flat.view(torch.uint8).numpy().tobytes()]


def _unpackb(data: memoryview | bytes, depth: int) -> Any:
    return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True, object_pairs_hook=_str_keyed,
                           ext_hook=functools.partial(_from_ext, depth=depth + 1))


def _str_keyed(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    for key, _ in pairs:
        if type(key) is not str:
            raise WireError(f"dict keys must be str, got {type(key).__name__}")
    return dict(pairs)


def _from_ext(code: int, data: bytes, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise WireError(f"message nested deeper than {MAX_DEPTH}")
    value = _unpackb(data, depth)
    if code == _TUPLE:
        if type(value) is not list:
            raise WireError("a tuple that holds no list")
        return tuple(value)
    if code == _TENSOR:
        return _tensor_from(value)
    if code == _RECORD:
        return _record_from(value)
    raise WireError(f"unknown ext type {code}")


def _tensor_from(value: Any) -> torch.Tensor:
    if not (type(value) is list and len(value) == 3):
        raise WireError("a tensor is [dtype, shape, bytes]")
    name, shape, raw = value
    dtype = TENSOR_DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise WireError(f"tensor dtype {name!r} is not allowed (allowed: {', '.join(TENSOR_DTYPES)})")
    if not (type(shape) is list and len(shape) <= MAX_TENSOR_DIMS
            and all(type(n) is int and n >= 0 for n in shape)) or type(raw) is not bytes:
        raise WireError(f"a tensor's shape must be at most {MAX_TENSOR_DIMS} sizes >= 0 and its data bytes")
    expected = math.prod(shape) * dtype.itemsize
    if expected != len(raw):
        raise WireError(f"tensor {name}{shape} needs {expected} bytes, the message holds {len(raw)}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _record_from(value: Any) -> Any:
    if not (type(value) is list and len(value) == 2 and type(value[0]) is str and type(value[1]) is dict):
        raise WireError("a record is [name, fields]")
    name, values = value
    record = _BY_NAME.get(name)
    if record is None:
        raise WireError(f"{name!r} is not a type that travels on the tensor-parallel channel")
    if values.keys() != record.fields:
        missing, unknown = sorted(record.fields - values.keys()), sorted(values.keys() - record.fields)
        raise WireError(f"{name} fields differ: missing {missing}, unknown {unknown}")
    try:
        return record.from_fields(values)
    except WireError:
        raise
    except (TypeError, ValueError) as error:
        raise WireError(f"{name} refused: {error}") from None
