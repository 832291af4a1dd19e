"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, written by llm-compressor): the
`config_groups` of a `quantization_config` say, per group of `targets` (`Linear`, or `re:` patterns of module
names) minus `ignore`, how each linear weight is stored:

- `pack-quantized` (W4A16, W8A16): signed int4/int8 values offset to unsigned and packed densely into int32
  (`weight_packed` [out, in * bits / 32], value i of a row at bits i * bits), `weight_shape`, `weight_scale`
  per output channel ([out, 1]) or per group of `group_size` input columns ([out, in / group_size]); asymmetric
  schemes add `weight_zero_point`, packed the same way along the output rows; `actorder: group` adds
  `weight_g_idx` (the group of each input column);
- `int-quantized` (W8A8 int8) and `naive-quantized`: `weight` as int8, `weight_scale` (and zero points);
- `float-quantized` (W8A8 FP8): `weight` as float8_e4m3, `weight_scale` per tensor, channel or block.

The weight is (q - zero_point) * scale, computed in float32 and stored in the model dtype. Served by
dequantizing at load (layers/quantization/linear_method.py keeps int8/int4 weights quantized where it
pays: on the CPU's float32, int4 and per-channel int8 run with bf16 activations; float-quantized e4m3 weights
stay one byte each on CUDA, through the Triton kernel that decodes e4m3, and are dequantized on the CPU). A
group's `input_activations` (W8A8: int8 or FP8, dynamic per token or group, static per tensor with
`input_scale` / `input_zero_point`) quantize each quantized layer's input as the compressed-tensors
package's forward does (activations.py, w8a8.py; W4A8's int4 kept packed: w4a8.py); `output_activations` are
refused. `k_scale`/`v_scale` (a `kv_cache_scheme`) are the FP8 KV cache's scales (kv_cache_dtype.py)."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .activations import ActivationScheme
from .errors import QuantizationError
from .packing import unpack_columns, unpack_rows

FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
AUXILIARY = ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "weight_global_scale",
             "input_scale", "input_zero_point", "output_scale", "output_zero_point", "k_scale", "v_scale")


@dataclass(frozen=True)
class WeightScheme:
    num_bits: int
    type: str  # int | float
    symmetric: bool
    strategy: str  # tensor | channel | group | block
    group_size: int | None
    block: tuple[int, int] | None
    format: str
    targets: tuple[str, ...]
    inputs: ActivationScheme | None = None  # input_activations (W8A8), None: weight-only


@dataclass(frozen=True)
class CompressedTensorsConfig:
    method = "compressed-tensors"
    schemes: tuple[WeightScheme, ...]
    ignore: tuple[str, ...]
    kv_cache_scheme: dict | None = None
    input_scale_names = ("input_scale",)

    @classmethod
    def from_dict(cls, qc: dict) -> CompressedTensorsConfig:
        default_format = qc.get("format") or "dense"
        schemes = []
        for name, group in (qc.get("config_groups") or {}).items():
            weights = group.get("weights")
            if group.get("output_activations"):
                raise QuantizationError(f"compressed-tensors output_activations (config group {name}) are not served")
            if not weights:
                if group.get("input_activations"):
                    raise QuantizationError(f"compressed-tensors config group {name} quantizes activations of float "
                                            "weights, which is not served; W8A8 and weight-only groups are")
                continue
            fmt = group.get("format") or default_format
            if fmt not in FORMATS:
                raise QuantizationError(f"compressed-tensors format {fmt!r} (config group {name}) is not served; "
                                        f"kubeinfer serves {', '.join(FORMATS)}")
            strategy = str(weights.get("strategy") or "tensor").lower()
            if strategy not in ("tensor", "channel", "group", "block"):
                raise QuantizationError(f"compressed-tensors weight strategy {strategy!r} (config group {name}) "
                                        "is not served; tensor, channel, group and block are")
            kind = str(weights.get("type", "int")).lower()
            bits = int(weights.get("num_bits", 8))
            if (kind, bits) not in (("int", 4), ("int", 8), ("float", 8)):
                raise QuantizationError(f"compressed-tensors {kind}{bits} weights (config group {name}) are not "
                                        "served; int4, int8 and float8 are")
            block = weights.get("block_structure")
            inputs = group.get("input_activations")
            schemes.append(WeightScheme(bits, kind, bool(weights.get("symmetric", True)), strategy,
                                        weights.get("group_size"), tuple(block) if block else None, fmt,
                                        tuple(group.get("targets") or ()),
                                        ActivationScheme.from_args(inputs, f"config group {name}") if inputs else None))
        return cls(tuple(schemes), tuple(qc.get("ignore") or ()), qc.get("kv_cache_scheme"))

    def describe(self) -> str:
        kinds = sorted({f"{s.format} {s.type}{s.num_bits} {s.strategy}"
                        + (f", activations {s.inputs.describe()}" if s.inputs else "") for s in self.schemes})
        return f"{self.method} ({'; '.join(kinds)}), weights dequantized to the model dtype"

    def input_activations(self, module: str) -> ActivationScheme | None:
        """How a quantized layer's input is quantized (w8a8.py); None: it stays in the model dtype."""
        return self.scheme_of(module).inputs

    @staticmethod
    def auxiliary(key: str) -> bool:
        return key.rsplit(".", 1)[-1] in AUXILIARY

    @staticmethod
    def weight_key(key: str) -> str:
        return key[:-len("_packed")] if key.endswith(".weight_packed") else key

    def scheme_of(self, module: str) -> WeightScheme:
        """The scheme of the config group whose targets match the module, the most specific match first as the
        compressed-tensors package orders them: the module's exact name, then a `re:` pattern, then a class
        name (`Linear` matches every linear). Mixed configs (int8 attention, int4 `re:.*experts.*`) need it."""
        for matches in (lambda t: t == module, lambda t: t.startswith("re:") and re.match(t[3:], module),
                        lambda t: t == "Linear"):
            for scheme in self.schemes:
                if any(matches(t) for t in scheme.targets):
                    return scheme
        if len(self.schemes) == 1:  # a class name other than Linear (e.g. the family's own) still means these
            return self.schemes[0]
        raise QuantizationError(f"quantized weight {module} matches no config group's targets")

    def read(self, key: str, tensor: torch.Tensor, get) -> torch.Tensor:
        """The float32 weight of `key` (a `weight_packed`, or a `weight` stored as int8/fp8); others as stored."""
        parts = self._integers(key, tensor, get)
        return tensor if parts is None else dequantize(*parts, key)

    def int_weight(self, key: str, tensor: torch.Tensor, get):
        """The weight as integers for a kept-quantized layer (linear_method.IntWeight): int4/int8 by group or
        channel without g_idx; None for anything else (read() dequantizes it)."""
        from .linear_method import IntWeight

        parts = self._integers(key, tensor, get)
        if parts is not None and parts[3].type == "float":
            return _float8_weight(*parts)
        if parts is None or parts[3].type != "int" or parts[3].strategy not in ("group", "channel") or parts[4] is not None:
            return None
        values, scale, zero, scheme, _ = parts
        rows, cols = values.shape
        group = scheme.group_size if scheme.strategy == "group" else cols
        groups = -(-cols // group)
        if scale.numel() != rows * groups or (zero is not None and zero.numel() != rows * groups):
            return None  # a broken checkpoint: read() says what is wrong
        return IntWeight(values.to(torch.int8), scale.to(torch.float32).reshape(rows, groups),
                         None if zero is None else zero.to(torch.int8).reshape(rows, groups), group, scheme.num_bits)

    def checkpoint_slice(self, key: str, lazy, get, dim: int, start: int, length: int):
        """A tensor-parallel rank's part of a pack-quantized weight as a smaller checkpoint, read from the file
        (`lazy`: safetensors' get_slice): (packed tensor, get) for `int_weight`. dim 0: output rows (the packed
        zero points' words whole); dim 1: input columns, on word and group boundaries. None where the cut
        does not fall so, or with g_idx: the loader cuts the whole weight instead."""
        if not key.endswith(".weight_packed"):
            return None
        module = key.rsplit(".", 1)[0]
        shape = get(f"{module}.weight_shape")
        if shape is None or get(f"{module}.weight_g_idx") is not None:
            return None
        scheme, (rows, cols) = self.scheme_of(module), (int(v) for v in shape.tolist())
        per, end = 32 // scheme.num_bits, start + length
        scale, zero = get(f"{module}.weight_scale"), get(f"{module}.weight_zero_point")
        if scale is None or scale.dim() != 2 or scheme.strategy not in ("group", "channel") or (start | length) % per:
            return None
        if dim == 0:
            tensor, shape = lazy[start:end], [length, cols]
            scale, zero = scale[start:end], None if zero is None else zero[start // per:end // per]
        else:
            group = scheme.group_size if scheme.strategy == "group" else None
            if group and (start % group or length % group):
                return None
            tensor, shape = lazy[:, start // per:end // per], [rows, length]
            if group:
                groups = slice(start // group, end // group)
                scale, zero = scale[:, groups], None if zero is None else zero[:, groups]
        parts = {"weight_shape": torch.tensor(shape), "weight_scale": scale, "weight_zero_point": zero}
        return tensor, lambda k: parts[k.rsplit(".", 1)[1]] if k.startswith(module + ".") and \
            k.rsplit(".", 1)[1] in parts else get(k)

    def _integers(self, key: str, tensor: torch.Tensor, get):
        """(values, scale, zero, scheme, g_idx) of a quantized weight, or None for a float one."""
        module = key.rsplit(".", 1)[0]
        packed = key.endswith(".weight_packed")
        if not packed and tensor.is_floating_point() and tensor.element_size() > 1:
            return None  # a float weight: ignored by the config, or not a linear layer
        scheme = self.scheme_of(module)
        scale = get(f"{module}.weight_scale")
        if scale is None:
            raise QuantizationError(f"quantized weight {key!r} has no weight_scale in the checkpoint")
        if packed:
            shape = get(f"{module}.weight_shape")
            if shape is None:
                raise QuantizationError(f"packed weight {key!r} has no weight_shape in the checkpoint")
            rows, cols = (int(v) for v in shape.tolist())
            if tensor.shape[0] != rows or tensor.shape[1] * 32 // scheme.num_bits < cols:
                raise QuantizationError(f"packed weight {key!r} of shape {tuple(tensor.shape)} cannot hold "
                                        f"weight_shape {[rows, cols]} at {scheme.num_bits} bits")
            values = unpack_columns(tensor, scheme.num_bits, cols) - (1 << (scheme.num_bits - 1))
        else:
            values, rows, cols = tensor, tensor.shape[0], tensor.shape[1]
        zero = None if scheme.symmetric else get(f"{module}.weight_zero_point")
        if not scheme.symmetric and zero is None:
            raise QuantizationError(f"asymmetric weight {key!r} has no weight_zero_point in the checkpoint")
        if zero is not None and packed:
            zero = unpack_rows(zero, scheme.num_bits, rows) - (1 << (scheme.num_bits - 1))
        return values, scale, zero, scheme, get(f"{module}.weight_g_idx")


def _float8_weight(values, scale, zero, scheme: WeightScheme, g_idx):
    """float-quantized e4m3 kept (linear_method.IntWeight, fp8; on CUDA): its scale as one per output row and
    group of columns, a block's repeated over its rows. None where it does not fit (read() says why)."""
    from .linear_method import IntWeight

    if values.dtype != torch.float8_e4m3fn or zero is not None or g_idx is not None or values.dim() != 2:
        return None
    rows, cols = values.shape
    s = scale.to(torch.float32)
    if s.numel() == 1:
        grid, group = s.reshape(1, 1).expand(rows, 1), cols
    elif scheme.strategy == "channel" and s.numel() == rows:
        grid, group = s.reshape(rows, 1), cols
    elif scheme.strategy == "group" and scheme.group_size and tuple(s.shape) == (rows, -(-cols // scheme.group_size)):
        grid, group = s, scheme.group_size
    elif scheme.strategy == "block" and scheme.block and tuple(s.shape) == (-(-rows // scheme.block[0]),
                                                                           -(-cols // scheme.block[1])):
        grid, group = s.repeat_interleave(scheme.block[0], dim=0)[:rows], scheme.block[1]
    else:
        return None
    return IntWeight(values.contiguous(), grid.contiguous(), None, group, 8, fp8=True)


def expand(grid: torch.Tensor, rows: int, cols: int, scheme: WeightScheme, g_idx, name: str) -> torch.Tensor:
    """A scale or zero-point grid as one value per weight element ([rows, cols])."""
    g = grid.to(torch.float32)
    if g.numel() == 1:
        return g.reshape(1, 1).expand(rows, cols)
    if scheme.strategy == "channel" and g.numel() == rows:
        return g.reshape(rows, 1).expand(rows, cols)
    if scheme.strategy == "group" and g.dim() == 2 and g.shape[0] == rows:
        if g_idx is not None:
            if g_idx.numel() != cols or int(g_idx.max()) >= g.shape[1]:
                raise QuantizationError(f"weight_g_idx of {name} does not fit its {cols} columns and "
                                        f"{g.shape[1]} groups")
            return g.index_select(1, g_idx.long())
        size = scheme.group_size
        if size and g.shape[1] == -(-cols // size):
            return g.repeat_interleave(size, dim=1)[:, :cols]
    if scheme.strategy == "block" and scheme.block and g.dim() == 2:
        bn, bk = scheme.block
        if tuple(g.shape) == (-(-rows // bn), -(-cols // bk)):
            return g.repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]
    raise QuantizationError(f"scale or zero point of {name} has shape {tuple(grid.shape)}, which does not fit a "
                            f"{rows}x{cols} weight quantized by {scheme.strategy}"
                            + (f" (group_size {scheme.group_size})" if scheme.strategy == "group" else "")
                            + " (truncated or mismatched checkpoint)")


def dequantize(values: torch.Tensor, scale: torch.Tensor, zero, scheme: WeightScheme, g_idx, name: str) -> torch.Tensor:
    rows, cols = values.shape
    w = values.to(torch.float32)
    if zero is not None:
        w = w - expand(zero, rows, cols, scheme, g_idx, name)
    return w * expand(scale, rows, cols, scheme, g_idx, name)
