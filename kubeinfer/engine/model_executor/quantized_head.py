"""A checkpoint with tied embeddings (`tie_word_embeddings`) whose lm_head is quantized all the same (an
llm-compressor recipe that targets lm_head stores the head's integers beside the float embedding): the head
is untied and kept quantized like the other linear layers, the embedding stays float. A checkpoint that holds
only the quantized copy is refused: the embedding's rows would have to be dequantized from it, which the
engine does not do (nor does any format define it)."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .model_files import ModelLoadError

HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def untie_quantized_head(model: nn.Module, weight_files: list[Path], quantization) -> bool:
    """Unties `model.lm_head` from the embedding where the checkpoint quantizes it (module docstring); whether it
    did."""
    if quantization is None or not model.spec.tie_word_embeddings:
        return False
    head, embedding = [], False
    for file in weight_files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if quantization.auxiliary(key):
                    continue
                ours = model.checkpoint_name(quantization.weight_key(key))
                if ours == HEAD and (key != quantization.weight_key(key) or _integer(f, key)):
                    head.append(key)
                embedding = embedding or (ours == EMBEDDING and not _integer(f, key))
    if not head:
        return False
    if not embedding:
        raise ModelLoadError(f"tie_word_embeddings is set and the checkpoint holds only a quantized lm_head "
                             f"({head[0]}), no float {EMBEDDING}: kubeinfer keeps the embedding float and does not "
                             "dequantize it from the head; export the checkpoint with its float embedding")
    embed = model.model.embed_tokens.weight
    # a shape, allocated only if written in float (layers/deferred_weight.py): kept quantized, it never is
    model.lm_head.weight = nn.Parameter(torch.empty(embed.shape, dtype=embed.dtype, device="meta"),
                                        requires_grad=False)
    model.lm_head.deferred_device = embed.device
    return True


def _integer(f, key: str) -> bool:
    """Stored as integers or fp8 (a quantized weight), not float16/bf16/float32."""
    return f.get_slice(key).get_dtype() not in ("F16", "BF16", "F32", "F64")
