"""One layer's product per CPU kernel, the measurement behind layers/quantization/linear_method.py's choice
(`python benchmarks/bench_quantized_decode.py --kernels`): a [tokens, 2048] x [8192, 2048] product at 1 and 16
tokens, with torch on 1 thread (what a decode step runs: layers/cpu_blas.py) and on 2, through
  * the float weight: OpenBLAS float32 (the engine's float32 decode path), `F.linear` float32 and bf16;
  * torch's weight-only products `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` (group 128), float32
    and bf16 activations;
  * `torch._int_mm` with the activations quantized per token to int8 (what llama.cpp's Q8_0 product does
    inside; not used for weight-only checkpoints, whose activations are 16-bit by definition).
Calls are interleaved, kernel after kernel, and the fastest of --calls rounds is reported (the machine is shared)."""
from __future__ import annotations

import os
import platform
import time

import numpy as np
import torch
import torch.nn.functional as F
from results import update_results

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

    return {
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
                      "int8 weights kept, through torch's products with bf16 activations."])
    update_results("quantized-kernels", "Quantized weights: one layer's product per CPU kernel", body)
