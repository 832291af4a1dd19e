"""One layer's product per CPU kernel, the measurement behind layers/quantization/linear_method.py's choice
(`python benchmarks/bench_quantized_decode.py --kernels`): a [tokens, 2048] x [8192, 2048] product at 1 and 16
tokens, with torch on 1 thread (what a decode step runs: platforms/cpu/cpu_blas.py) and on 2, through
  * the float weight: OpenBLAS float32 (the engine's float32 decode path), `F.linear` float32 and bf16;
  * torch's weight-only products `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` (group 128), float32
    and bf16 activations;
  * `torch._int_mm` with the activations quantized per token to int8 (what llama.cpp's Q8_0 product does
    inside; not used for weight-only checkpoints, whose activations are 16-bit by definition);
  * the native AVX-512 VNNI kernels (platforms/cpu/native, their own thread pool set to the same
    count): the exact W8A8 int8 product (bit for bit `_int_mm`'s, the activation quantization included) and
    llama.cpp's arithmetic (activations to Q8_0 blocks of 32) with int8 per-channel and int4 group-128 weights.
Calls are interleaved, kernel after kernel, and the fastest of --calls rounds is reported (the machine is shared)."""
from __future__ import annotations

import os
import platform
import time

import numpy as np
import torch
import torch.nn.functional as F
from results import update_results

from kubeinfer.engine.model_executor.layers.quantization.activations import ActivationScheme
from kubeinfer.engine.platforms.cpu.native import ops

OUT, COLS, GROUP = 8192, 2048, 128


def _kernels(tokens: int):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(OUT, COLS, generator=gen) * 0.02
    scale = w.abs().amax(1) / 127
    q8 = (w / scale[:, None]).round().to(torch.int8)
    q8_t = q8.t().contiguous()
    q4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (OUT, COLS), generator=gen, dtype=torch.int32), 1)
    scales_zeros = torch.rand(COLS // GROUP, OUT, 2, generator=gen)
    w_np, w_bf16 = w.numpy().T, w.bfloat16()
    x = torch.randn(tokens, COLS, generator=gen)

    def int_mm():
        step = x.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
        return torch._int_mm((x / step).round_().to(torch.int8), q8_t).float() * step * scale

    native = {}
    if ops.available():
        token = ActivationScheme("int", "token", True)
        p8, p4 = ops.pack_int8(q8), ops.pack_int4(torch.randint(-8, 8, (OUT, COLS), generator=gen, dtype=torch.int8))
        s8 = ops.pack_groups(scale[:, None], torch.float32)
        s4 = ops.pack_groups(scales_zeros[..., 0].t(), torch.float32)
        p8_2 = p8.clone()  # its own copy: not left in the cache by the W8A8 row before it
        o8 = ops.pack_groups(torch.full((OUT, 1), 128, dtype=torch.int32), torch.int32)
        o4 = ops.pack_groups(torch.full((OUT, COLS // GROUP), 8, dtype=torch.int32), torch.int32)
        native = {"native W8A8 (exact)": lambda: ops.w8a8_linear(x, token, p8, scale),
                  "native Q8_0 act. x int8": lambda: ops.q8_0_linear(x, p8_2, 8, s8, o8, COLS, OUT),
                  "native Q8_0 act. x int4": lambda: ops.q8_0_linear(x, p4, 4, s4, o4, GROUP, OUT)}
    return native | {
        "OpenBLAS float32": lambda: np.matmul(x.numpy(), w_np),
        "`F.linear` float32": lambda: F.linear(x, w),
        "`F.linear` bf16": lambda: F.linear(x.bfloat16(), w_bf16).float(),
        "int8pack, float32 act.": lambda: torch.ops.aten._weight_int8pack_mm(x, q8, scale),
        "int8pack, bf16 act.": lambda: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q8, scale.bfloat16()).float(),
        "int4pack, float32 act.": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4, GROUP, scales_zeros),
        "int4pack, bf16 act.": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), q4, GROUP, scales_zeros.bfloat16()).float(),
        "`_int_mm`, int8 act. per token": int_mm,
    }


def kernel_times(calls: int = 15) -> None:
    results = {}
    threads_before = torch.get_num_threads()
    with torch.inference_mode():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            if ops.available():
                ops.set_threads(threads)
            for tokens in (1, 16):
                kernels = _kernels(tokens)
                best = dict.fromkeys(kernels, float("inf"))
                for _ in range(calls):
                    for name, fn in kernels.items():
                        start = time.perf_counter()
                        fn()
                        best[name] = min(best[name], time.perf_counter() - start)
                results[(threads, tokens)] = best
                print(threads, tokens, {k: f"{v * 1e3:.2f}" for k, v in best.items()}, f"load {os.getloadavg()[0]:.1f}")
    torch.set_num_threads(threads_before)
    if ops.available():
        ops.set_threads(ops.default_threads())
    names = list(results[(1, 1)])
    lines = ["| torch threads | tokens | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    lines += [f"| {t} | {n} | " + " | ".join(f"{best[k] * 1e3:.2f}" for k in names) + " |"
              for (t, n), best in results.items()]
    body = "\n".join([f"Command: `python benchmarks/bench_quantized_decode.py --kernels`. Machine: "
                      f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs (load average "
                      f"{os.getloadavg()[0]:.1f} at the end), torch {torch.__version__}. One [tokens, {COLS}] x "
                      f"[{OUT}, {COLS}] product in ms, fastest of "
                      f"{calls} interleaved calls (OpenBLAS uses its own threads whatever torch's count).", "", *lines,
                      "", "The engine's choice on the CPU (layers/quantization/linear_method.py) follows: int4 and "
                      "int8 weights kept, through torch's products with bf16 activations; W8A8 int8 layers through "
                      "the native kernel (exact); the native llama.cpp arithmetic is opt-in (KUBEINFER_QUANT_KERNEL)."])
    update_results("quantized-kernels", "Quantized weights: one layer's product per CPU kernel", body)
