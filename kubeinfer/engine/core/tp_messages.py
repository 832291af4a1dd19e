"""What rank 0 sends the other ranks of a tensor-parallel group, and nothing else: each message kind with the
types of its arguments, and the dataclasses that travel in them (registered with distributed/wire.py).

    ("config", EngineConfig)                 once, first: rank 0's settings
    ("step", StepInputs, token_slots | None) every step
    ("lora", slot, LoRAAdapter)              an adapter written into a slot
    ("profile", step_tokens, max_num_seqs)   the profiling step (CUDA)
    ("kv_cache", blocks, window_blocks|None) the KV cache's size
    ("graphs", max_num_seqs, eagerly)        capture decode graphs
    ("stop",)                                a clean end

Both sides check a message against this table: rank 0 before encoding, a worker after decoding."""
from __future__ import annotations

from typing import Any

import torch

from ..config import EngineConfig
from ..distributed import wire
from ..lora.adapter import LoRAAdapter, LoRAWeights
from ..model_executor.step_inputs import StepInputs

_NONE = type(None)
KINDS: dict[str, tuple[type | tuple[type, ...], ...]] = {
    "config": (EngineConfig,),
    "step": (StepInputs, (list, _NONE)),
    "lora": (int, LoRAAdapter),
    "profile": (int, int),
    "kv_cache": (int, (int, _NONE)),
    "graphs": (int, bool),
    "stop": (),
}


def check_message(message: Any) -> tuple:
    """`message` if it is one of KINDS with arguments of its types; wire.WireError otherwise."""
    if type(message) is not tuple or not message or message[0] not in KINDS:
        head = message[0] if type(message) is tuple and message else message
        raise wire.WireError(f"not a tensor-parallel message: {str(head)[:80]!r}")
    kind, args = message[0], message[1:]
    types = KINDS[kind]
    if len(args) != len(types) or not all(isinstance(a, t) for a, t in zip(args, types)):
        got = ", ".join(type(a).__name__ for a in args)
        raise wire.WireError(f"{kind!r} message with arguments ({got}), expected {len(types)} of {types}")
    return message


def _adapter_fields(adapter: LoRAAdapter) -> dict[str, Any]:
    """Its weights as [layer, module, A, B] rows (the dict's keys are tuples); not its path (rank 0's disk)."""
    return {"name": adapter.name, "id": adapter.id, "rank": adapter.rank, "scaling": float(adapter.scaling),
            "weights": [[layer, module, w.a, w.b] for (layer, module), w in adapter.weights.items()]}


def _adapter_from(fields: dict[str, Any]) -> LoRAAdapter:
    weights = {}
    for row in fields["weights"]:
        if not (type(row) is list and len(row) == 4 and type(row[0]) is int and type(row[1]) is str
                and all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in row[2:])):
            raise wire.WireError("an adapter's weights are [layer, module, A, B] rows of 2-D tensors")
        weights[(row[0], row[1])] = LoRAWeights(row[2], row[3])
    if not (type(fields["name"]) is str and type(fields["id"]) is int and type(fields["rank"]) is int
            and type(fields["scaling"]) is float):
        raise wire.WireError("an adapter's name, id, rank and scaling are str, int, int and float")
    return LoRAAdapter(fields["name"], fields["id"], fields["rank"], fields["scaling"], weights)


wire.register(EngineConfig)
wire.register(StepInputs)
wire.register(LoRAAdapter, fields=("name", "id", "rank", "scaling", "weights"), to_fields=_adapter_fields,
              from_fields=_adapter_from)
