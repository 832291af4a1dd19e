"""One W8A8 row-parallel layer over a real tensor-parallel group (2 ranks, gloo, spawned processes), against the
same layer on one rank (tests/engine/test_quantized_w8a8_tp.py). A module of its own so the spawned ranks import it
by name."""
from __future__ import annotations

import torch

from kubeinfer.engine.config import Part
from kubeinfer.engine.model_executor.layers.linear import RowParallelLinear
from kubeinfer.engine.model_executor.layers.quantization.activations import ActivationScheme
from kubeinfer.engine.model_executor.layers.quantization.linear_method import dense
from kubeinfer.engine.model_executor.layers.quantization.w8a8 import ActivationQuantMethod

IN, OUT = 128, 96
CASES = {  # name: (scheme, kernel)
    "int8_token": (ActivationScheme("int", "token", True), "fake_quant"),
    "int8_token_int_mm": (ActivationScheme("int", "token", True), "int_mm"),
    "int8_token_asym": (ActivationScheme("int", "token", True, symmetric=False), "fake_quant"),
    "fp8_token": (ActivationScheme("float", "token", True), "fake_quant"),
    "fp8_group": (ActivationScheme("float", "group", True, group_size=32), "fake_quant"),
    "int8_static": (ActivationScheme("int", "tensor", False), "fake_quant"),
}


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [tokens, IN] whose two halves reach different ranges token by token (so a rank's own half would give
    another scale), an all-zero token, an all-positive one; int8 weights, per-row scales, a bias."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(20, IN, generator=g) * torch.logspace(-2, 1, 20).unsqueeze(1)
    x[:, IN // 2:] *= torch.linspace(0.1, 8, 20).unsqueeze(1)
    x[3] = 0
    x[6] = x[6].abs() + 0.25
    q = torch.randint(-127, 128, (OUT, IN), dtype=torch.int8, generator=g)
    return x, q, torch.rand(OUT, generator=g) * 0.01 + 0.001, torch.randn(OUT, generator=g)


def layer_output(name: str, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's layer (its input columns) run on its slice of x: the layer's output (after the group's
    all-reduce) and the quantized input its product received (None for int_mm, whose int8 input is internal)."""
    scheme, kernel = CASES[name]
    x, q, row_scale, bias = inputs()
    width = IN // size
    cols = slice(rank * width, (rank + 1) * width)
    layer = RowParallelLinear(Part(IN, rank * width, width), OUT, True, size)
    with torch.no_grad():
        layer.weight.copy_(q[:, cols].float() * row_scale[:, None])
        layer.bias.copy_(bias)
    seen = {}

    def record(layer, xq, with_bias):
        seen["x"] = xq
        return dense(layer, xq, with_bias)

    static = torch.tensor([0.05]) if not scheme.dynamic else None
    int_mm = (q[:, cols].t().contiguous(), row_scale) if kernel == "int_mm" else None
    method = ActivationQuantMethod(layer, scheme, record, [(0, OUT, 0)], static, None, int_mm)
    layer.quant_method = method  # RowParallelLinear calls it from its own forward
    with torch.no_grad():
        out = layer(x[:, cols])
    return out, seen.get("x")


def rank_main(rank: int, port: int, out_dir: str) -> None:
    import os

    from kubeinfer.engine.distributed.parallel_state import destroy_group, init_group
    from kubeinfer.engine.model_executor.layers.quantization import w8a8_tp

    if os.environ.get("KUBEINFER_TEST_LOCAL_RANGES"):  # the guard: each rank's own range, no collective
        w8a8_tp.whole_token_range = lambda lo, hi: (lo, hi)
    init_group(rank, 2, rank, "127.0.0.1", port, torch.device("cpu"), 60)
    try:
        torch.save({name: layer_output(name, rank, 2) for name in CASES}, f"{out_dir}/rank{rank}.pt")
    finally:
        destroy_group()
