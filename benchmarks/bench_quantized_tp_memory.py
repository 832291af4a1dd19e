"""Weight memory of one tensor-parallel rank with an int4 checkpoint: the decoder projections' bytes that rank 0
holds, at one rank and at two, per kernel (KUBEINFER_QUANT_KERNEL), under bf16, counted from the loaded
parameters as the start-up log counts them. A byte count, not a timing: the load on the machine does not
change it. The checkpoint is the benchmark model (bench_throughput.MODEL_SHAPE) written as compressed-tensors
W4A16 (asymmetric, groups of 128) by the `compressed-tensors` package.

    python benchmarks/bench_quantized_tp_memory.py
"""
from __future__ import annotations

import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from bench_throughput import MODEL_SHAPE
from quant_checkpoints import ct_compress, ct_scheme, float_weights, write_checkpoint
from results import update_results

from kubeinfer.engine.model_executor.layers.attention_selector import get_attention_backend
from kubeinfer.engine.model_executor.model_loader import inspect_model_dir, load_model
from kubeinfer.dev.testing.random_model import build_random_model

KERNELS = {"dequantized": "dequantized (float)", "cpu_int4": "cpu_int4", "triton": "triton layout"}


def projection_bytes(model_dir: str, kernel: str, rank: int, size: int) -> int:
    os.environ["KUBEINFER_QUANT_KERNEL"] = kernel
    model = load_model(inspect_model_dir(model_dir), get_attention_backend("torch"), 64, torch.device("cpu"),
                       torch.bfloat16, rank, size)
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if ".layers." in n and "_proj." in n and p.device.type != "meta")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        float_dir = build_random_model(Path(tmp) / "float", "llama", tokenizer=False, seed=0, **MODEL_SHAPE)
        config = ct_scheme("pack-quantized", 4, "int", "group", False, 128)
        model_dir = write_checkpoint(float_dir, Path(tmp) / "w4", ct_compress(float_weights(float_dir), config), config)
        rows = []
        for kernel, label in KERNELS.items():
            one, two = (projection_bytes(model_dir, kernel, 0, size) for size in (1, 2))
            rows.append(f"| {label} | {one / 2 ** 20:.2f} | {two / 2 ** 20:.2f} | {two / one:.2f} |")
            print(rows[-1])
    body = ("Decoder projections' bytes held by rank 0, bf16 model, compressed-tensors W4A16 (asymmetric, groups "
            "of 128) of the benchmark model. Before the int weights were cut per rank, two ranks dequantized them "
            "whole and then cut, so rank 0 held the dequantized row's TP=2 bytes whatever the kernel. "
            f"{platform.machine()}, torch {torch.__version__}.\n"
            "`python benchmarks/bench_quantized_tp_memory.py`\n\n"
            "| kernel | TP=1 MiB | TP=2 rank 0 MiB | ratio |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    update_results("quantized-tp-memory", "Int4 weights per tensor-parallel rank", body)


if __name__ == "__main__":
    main()
