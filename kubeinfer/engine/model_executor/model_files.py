"""A model directory, inspected before any weight is read: its config and architecture, its safetensors files,
its EOS ids, its quantization (checked against --quantization and the architecture's served methods), and the
dtype the engine runs it in. model_loader.py then reads the weights."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .layers.quantization import QuantizationError, resolve_quantization
from .models.registry import ARCHITECTURES, UnsupportedArchitecture, resolve


class ModelLoadError(ValueError):
    """The model directory cannot be served; the message says what to fix."""


@dataclass
class ModelFiles:
    path: Path
    config: object  # transformers PretrainedConfig
    architecture: str
    weight_files: list[Path]
    eos_token_ids: list[int]
    quantization: object = None  # the checkpoint's quantization (layers/quantization), None for float weights


def inspect_model_dir(model_dir: str | os.PathLike, quantization: str | None = None) -> ModelFiles:
    """`quantization`: --quantization, checked against the checkpoint's quantization_config."""
    from transformers import AutoConfig

    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json; expected a Hugging Face model directory")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    try:
        architecture = resolve(getattr(config, "architectures", None) or [])
    except UnsupportedArchitecture as error:
        raise ModelLoadError(str(error)) from None
    eos_token_ids = _eos_token_ids(path, config)
    try:
        quant = resolve_quantization(config, quantization)
    except QuantizationError as error:
        raise ModelLoadError(str(error)) from None
    served = [m.strip() for m in architecture.quantized.split(",")]
    method = getattr(quant, "method", None)
    if quant is not None and not getattr(quant, "at_load", False) and method not in served:
        served_by = [a.name for a in ARCHITECTURES.values() if method in a.quantized]
        raise ModelLoadError(f"this checkpoint is quantized with {method!r}, which kubeinfer serves for "
                             f"{', '.join(served_by)} only; for {architecture.name} it serves {', '.join(served)}")
    if architecture.text_only:  # the language model of a multimodal checkpoint: its text config describes it
        config = config.get_text_config()
    return ModelFiles(path, config, architecture.name, _weight_files(path), eos_token_ids, quant)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} lists shards that are missing from {path}: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if list(path.glob("*.bin")) or list(path.glob("*.pt")) or list(path.glob("*.pth")):
        raise ModelLoadError(f"{path} holds only pickle checkpoints (*.bin/*.pt); kubeinfer loads safetensors only, "
                             "which cannot run code on load. Convert with transformers: "
                             "model.save_pretrained(dir, safe_serialization=True)")
    raise ModelLoadError(f"no *.safetensors weights in {path}")


def _eos_token_ids(path: Path, config) -> list[int]:
    eos = None
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def resolve_dtype(dtype: str | torch.dtype | None, config, device: torch.device) -> torch.dtype:
    """None/"auto": the checkpoint's dtype on GPU; float32 on CPU, the exact choice. bfloat16 on a CPU with
    AVX512-BF16 or AMX runs about 1.6x faster (benchmarks/RESULTS.md), so it is there to ask for."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cpu":
            return torch.float32
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
        saved = getattr(torch, saved) if isinstance(saved, str) else saved
        return torch.bfloat16 if saved == torch.float32 else saved
    names = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype must be one of auto, {', '.join(names)}; got {dtype!r}")
    return names[dtype]
