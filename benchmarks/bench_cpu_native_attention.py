"""The native CPU decode attention (platforms/cpu/cpu_attention.py) against the torch path, in one process so the
load is
the same for both: KUBEINFER_CPU_NATIVE_LAYERS=1 and 0 alternate (read at each engine step).
One layer's attention step (TorchAttentionBackend.forward: the K/V write and the decode attention), the large
model's heads (16 query, 8 KV, head_dim 64), 1 and 16 sequences of 40-63 cached tokens in scattered blocks of 16,
float32 and bf16; fastest tenth of --calls, best of --rounds. Whole engine steps with the switch on and off (it
covers the attention and the small ops together): benchmarks/bench_cpu_fused_ops.py.
`python benchmarks/bench_cpu_native_attention.py [--rounds 3] [--calls 300]`"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # as the `kubeinfer` command does, before numpy loads
import torch  # noqa: E402

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests"),
                str(Path(__file__).parents[1] / "tests" / "engine")]


def per_call(rounds: int, calls: int) -> None:
    from test_cpu_native_attention import make_step

    from kubeinfer.engine.platforms.cpu import cpu_blas
    from kubeinfer.engine.model_executor.layers.attention import TorchAttentionBackend

    backend = TorchAttentionBackend()
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (1, 16):
            q, k_cache, v_cache, meta = make_step([40 + (i * 7) % 24 for i in range(batch)], 16, 8, 64, dtype, seed=1)
            k, v = torch.randn(batch, 8, 64).to(dtype), torch.randn(batch, 8, 64).to(dtype)
            best = {}
            with cpu_blas.small_step(True, share_cores=True):  # the engine's small-step threading
                for _ in range(rounds):
                    for native in ("0", "1"):
                        os.environ["KUBEINFER_CPU_NATIVE_LAYERS"] = native
                        times = []
                        for _ in range(calls):
                            start = time.perf_counter()
                            backend.forward(q, k, v, k_cache, v_cache, meta, 0.125)
                            times.append(time.perf_counter() - start)
                        best[native] = min(best.get(native, 1.0), sorted(times)[calls // 10])
            print(f"{str(dtype)[6:]} batch {batch:2d}: torch {best['0'] * 1e6:7.1f} us, native "
                  f"{best['1'] * 1e6:6.1f} us ({best['0'] / best['1']:.2f}x) load {os.getloadavg()[0]:.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    with torch.inference_mode():
        per_call(args.rounds, args.calls)


if __name__ == "__main__":
    main()
