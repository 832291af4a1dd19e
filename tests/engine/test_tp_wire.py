"""The tensor-parallel channel's schema (kubeinfer/engine/distributed/wire.py, core/tp_messages.py): every message kind
rank 0 sends survives the round trip exactly, tensors of every dtype that travels included; anything outside
the schema raises on encode and on decode, whatever bytes arrive."""
from __future__ import annotations

import dataclasses
import pickle

import msgpack
import numpy as np
import pytest
import torch

from kubeinfer.engine.config import EngineConfig
from kubeinfer.engine.core.tp_messages import KINDS, check_message
from kubeinfer.engine.distributed import wire
from kubeinfer.engine.lora.adapter import LoRAAdapter, LoRAWeights
from kubeinfer.engine.model_executor.step_inputs import StepInputs


def round_trip(message):
    return check_message(wire.decode(wire.encode(check_message(message))))


def step_inputs() -> StepInputs:
    inputs = StepInputs()
    inputs.add([5, 6, 7], 0, [3, 9], 4)
    inputs.add([8], 12, [1, 2, 4, 6], 4)
    inputs.add_window(1, 12, [0, 1, 2, 5], 4)
    inputs.logits_indices += [2, 3]
    inputs.num_decodes = 1
    inputs.pending = [(3, 0)]
    return inputs


def adapter(dtype: torch.dtype) -> LoRAAdapter:
    g = torch.Generator().manual_seed(0)
    weights = {(layer, module): LoRAWeights(torch.randn(4, 16, generator=g).to(dtype),
                                            torch.randn(24, 4, generator=g).to(dtype))
               for layer in range(2) for module in ("q_proj", "down_proj")}
    return LoRAAdapter("sql", 3, 4, 2.0, weights)


def test_every_message_kind_round_trips():
    config = EngineConfig("/models/x", tensor_parallel_size=2, kv_cache_dtype="fp8", enable_lora=True,
                          kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"},
                          max_model_len=256, dtype="bfloat16")
    messages = [("config", config), ("step", step_inputs(), None), ("step", step_inputs(), [0, 1, 2]),
                ("lora", 1, adapter(torch.float32)), ("profile", 512, 64), ("kv_cache", 100, None),
                ("kv_cache", 100, 40), ("graphs", 64, False), ("stop",)]
    assert {m[0] for m in messages} == set(KINDS)
    for message in messages:
        got = round_trip(message)
        if message[0] == "lora":
            sent, back = message[2], got[2]
            assert (back.name, back.id, back.rank, back.scaling, back.path) == ("sql", 3, 4, 2.0, None)
            assert back.weights.keys() == sent.weights.keys()
            for key, w in sent.weights.items():
                assert torch.equal(back.weights[key].a, w.a) and torch.equal(back.weights[key].b, w.b)
        else:
            assert got == message and type(got) is tuple
    assert type(round_trip(("step", step_inputs(), None))[1].pending[0]) is tuple


@pytest.mark.parametrize("dtype", list(wire.TENSOR_DTYPES.values()), ids=list(wire.TENSOR_DTYPES))
def test_tensors_of_every_allowed_dtype_round_trip(dtype):
    source = (torch.arange(-12, 12, dtype=torch.float32) / 3).reshape(2, 3, 4)
    for tensor in (source.to(dtype), source.to(dtype)[:, 1], torch.empty(0, 5, dtype=dtype), source[0, 0, 0].to(dtype)):
        back = wire.decode(wire.encode([tensor]))[0]
        assert back.dtype == dtype and back.shape == tensor.shape
        assert torch.equal(back.view(torch.uint8) if dtype.is_floating_point and dtype.itemsize == 1 else back,
                           tensor.contiguous().view(torch.uint8) if dtype.is_floating_point and dtype.itemsize == 1
                           else tensor)
    if dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert round_trip(("lora", 0, adapter(dtype)))[2].weights[(1, "q_proj")].a.dtype == dtype


def test_plain_values_round_trip():
    value = [None, True, False, 0, -1, 2**63 - 1, 1.5, "é", b"\x00\xff", [], (), {}, (1, [2, (3,)]),
             {"a": {"b": [1, 2.5, None]}}, [1, True, 2], [[1, 2], [3]]]
    assert wire.decode(wire.encode(value)) == value
    assert [type(v) for v in wire.decode(wire.encode(value))] == [type(v) for v in value]


@dataclasses.dataclass
class NotRegistered:
    x: int = 0


@pytest.mark.parametrize("value", [
    {1, 2}, object(), NotRegistered(), np.int64(3), [np.int64(3)], {1: "int key"}, {("a", 1): "tuple key"},
    torch.zeros(2, dtype=torch.complex64), torch.zeros((1,) * 9), 2**64, -2**63 - 1, lambda: 0, pickle,
    [[1, (2, object())]], {"a": {"b": {3: 4}}}, True.__class__.__base__, type("Int", (int,), {})(3),
    type("List", (list,), {})(), EngineConfig("m", speculative_config={1: 2}),
], ids=lambda v: type(v).__name__)
def test_anything_else_raises_on_encode(value):
    with pytest.raises(wire.WireError):
        wire.encode(("step", value))


def ext(code: int, value) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(value, use_bin_type=True))


def frame(value) -> bytes:
    return bytes([wire.VERSION]) + msgpack.packb(value, use_bin_type=True)


RECORD = 3
BAD_FRAMES = {
    "empty": b"",
    "other version": bytes([wire.VERSION + 1]) + msgpack.packb(["stop"]),
    "pickle": pickle.dumps(("stop",)),
    "pickle after the version": bytes([wire.VERSION]) + pickle.dumps(("stop",)),
    "truncated": frame(["stop", "x" * 10])[:-3],
    "trailing bytes": frame(["stop"]) + b"\x00",
    "int map key": frame({1: 2}),
    "int map key inside a list": frame([[{"a": {2: 3}}]]),
    "bytes map key": frame({b"k": 2}),
    "unknown ext": frame(msgpack.ExtType(42, b"")),
    "tensor dtype not allowed": frame(ext(2, ["complex64", [1], b"\x00" * 8])),
    "tensor dtype not a str": frame(ext(2, [1, [1], b"\x00" * 4])),
    "tensor bytes short": frame(ext(2, ["float32", [4], b"\x00" * 8])),
    "tensor huge shape": frame(ext(2, ["float32", [1 << 40, 1 << 40], b""])),
    "tensor negative size": frame(ext(2, ["float32", [-1], b""])),
    "tensor too many dims": frame(ext(2, ["uint8", [1] * 9, b"\x00"])),
    "unregistered record": frame(ext(RECORD, ["Popen", {"args": "sh"}])),
    "record missing a field": frame(ext(RECORD, ["StepInputs", {"input_ids": [1]}])),
    "record extra field": frame(ext(RECORD, ["LoRAAdapter", {"name": "a", "id": 1, "rank": 1, "scaling": 1.0,
                                                            "weights": [], "path": "/etc/passwd"}])),
    "record refused by its checks": frame(ext(RECORD, ["EngineConfig", {
        f.name: getattr(EngineConfig("m"), f.name) for f in dataclasses.fields(EngineConfig)} | {"block_size": 3}])),
    "adapter row not tensors": frame(ext(RECORD, ["LoRAAdapter", {"name": "a", "id": 1, "rank": 1, "scaling": 1.0,
                                                                 "weights": [[0, "q_proj", 1, 2]]}])),
    "deep nesting": frame(eval("ext(1, " * 40 + "[]" + ")" * 40)),
}


@pytest.mark.parametrize("data", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_anything_else_raises_on_decode(data):
    with pytest.raises(wire.WireError):
        wire.decode(data)
