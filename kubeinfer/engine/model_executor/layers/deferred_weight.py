"""Dense linear weights of a quantized checkpoint that are never allocated in float unless written in float.

A quantized checkpoint's projections are mostly kept quantized (quantization/linear_method.py): their float
weight would only be a shape. So, where the loader hands integer (fp8) weights over kept, it takes the decoder's
linear weights out before the model is allocated (`defer`) and puts them back as shapes on the meta device
(`restore`); `allocated` gives a layer its float weight on the device the moment something writes it in float
(a layer the kernel choice leaves dequantized, an ignored or float module, a layout dequantized as read). A
70B fp8 checkpoint on one 80 GB GPU then never takes 140 GB of bf16 at load, and the KV-cache budget the
engine profiles after loading is not shrunk by a float copy that was never used. Biases, norms, embeddings
and a tied LM head (the embedding's weight) are allocated as before; an untied LM head is deferred too (a checkpoint
may quantize it: its float weight would be vocabulary x hidden for nothing). The experts' float stacks are
deferred alike (fused_moe/layer.py)."""
from __future__ import annotations

import torch
from torch import nn


def defer(model: nn.Module) -> list[nn.Linear]:
    """Before `to_empty`: the float weights of every linear layer but a tied LM head taken out (shapes kept)."""
    tied = getattr(getattr(model, "spec", None), "tie_word_embeddings", True)
    layers = [m for name, m in model.named_modules() if isinstance(m, nn.Linear)
              and not (tied and (name == "lm_head" or name.endswith(".lm_head")))
              and isinstance(m._parameters.get("weight"), nn.Parameter)]
    for layer in layers:
        layer._deferred_shape = tuple(layer._parameters.pop("weight").shape)
    return layers


def restore(layers: list[nn.Linear], device: torch.device, dtype: torch.dtype) -> None:
    """After `to_empty`: each weight back as a shape on the meta device, allocated on `device` when written."""
    for layer in layers:
        layer.deferred_device = device
        layer.register_parameter("weight", nn.Parameter(torch.empty(layer.__dict__.pop("_deferred_shape"),
                                                                      dtype=dtype, device="meta"),
                                                         requires_grad=False))


def allocated(layer: nn.Module, param: torch.Tensor | None = None) -> torch.Tensor:
    """`param` (default: the layer's weight), allocated first when it is the layer's deferred float weight:
    the tensor to write into."""
    param = layer.weight if param is None else param
    if param is layer._parameters.get("weight") and param.device.type == "meta" \
            and getattr(layer, "deferred_device", None) is not None and getattr(layer, "quant_method", None) is None:
        param = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=layer.deferred_device),
                             requires_grad=False)
        layer.weight = param
    return param


def device_of(layer: nn.Module) -> torch.device:
    """Where the layer's weights live, its float weight deferred or not."""
    device = getattr(layer, "deferred_device", None)
    return device if device is not None and layer.weight.device.type == "meta" else layer.weight.device


def stand_in(layer: nn.Module) -> None:
    """A deferred weight as a zero-byte tensor of its shape on its device (one element, expanded), for a quant
    method that reads the weight's device and shape, then replaces it with its own parameters."""
    device = getattr(layer, "deferred_device", None)
    if device is not None and layer.weight.device.type == "meta":
        layer.weight = nn.Parameter(torch.empty((), dtype=layer.weight.dtype, device=device).expand(layer.weight.shape),
                                    requires_grad=False)


def unwritten(layers: list[nn.Linear]) -> list[nn.Linear]:
    """Deferred layers neither kept quantized nor written in float (a writer that skipped `allocated`)."""
    return [layer for layer in layers if layer.weight.device.type == "meta"
            and getattr(layer, "quant_method", None) is None and not hasattr(layer, "qweight_t")
            and not hasattr(layer, "qweight_vnni")]
