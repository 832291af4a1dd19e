"""The native CPU decode attention (layers/cpu_attention.py) against the torch path, in one process so the load is
the same for both: KUBEINFER_CPU_NATIVE_LAYERS=1 and 0 alternate (read at each engine step).
  * default: one layer's attention step (TorchAttentionBackend.forward: the K/V write and the decode attention),
    the large model's heads (16 query, 8 KV, head_dim 64), 1 and 16 sequences of 40-63 cached tokens in
    scattered blocks of 16, float32 and bf16; fastest tenth of --calls, best of --rounds;
  * --engine: whole decode steps of the bench_quantized_decode large model (its checkpoints under .cache, built
    here when missing), float32 and cpu_int8_vnni, batch 1 and 16, 32-token prompts, 32 tokens greedy; the
    median step after the first three of each round, best of --rounds (a warm-up round first).
`python benchmarks/bench_cpu_native_attention.py [--engine] [--rounds 3]`"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # as the `kubeinfer` command does, before numpy loads
import torch  # noqa: E402

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]


def per_call(rounds: int, calls: int) -> None:
    from test_cpu_native_attention import make_step

    from kubeinfer.engine.model_executor.layers import cpu_blas
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


def engines(rounds: int) -> None:
    from bench_quantized_decode import checkpoints

    from kubeinfer.engine import LLM, SamplingParams

    made = checkpoints("large")
    systems = {}
    for name, path, kernel in (("float32", made["float32"], None),
                               ("cpu_int8_vnni", made["w8a16"], "cpu_int8_vnni")):
        os.environ.pop("KUBEINFER_QUANT_KERNEL", None)
        if kernel:
            os.environ["KUBEINFER_QUANT_KERNEL"] = kernel
        systems[name] = LLM(str(path), max_num_seqs=16, enable_prefix_caching=False, num_kv_blocks=1024).engine
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 16000, (32,), generator=gen).tolist() for _ in range(16)]
    best: dict = {}
    for r in range(rounds + 1):
        for name, engine in systems.items():
            for batch in (1, 16):
                for native in ("0", "1"):
                    os.environ["KUBEINFER_CPU_NATIVE_LAYERS"] = native
                    for i in range(batch):
                        engine.add_request(f"{r}-{name}-{batch}-{native}-{i}", prompts[i], params)
                    steps = []
                    while engine.has_unfinished_requests():
                        start = time.perf_counter()
                        engine.step()
                        steps.append(time.perf_counter() - start)
                    median = sorted(steps[3:])[len(steps[3:]) // 2]
                    if r:  # round 0 warms up
                        best.setdefault((name, batch, native), []).append(median)
        print(f"round {r} done, load {os.getloadavg()[0]:.1f}", flush=True)
    for name in systems:
        for batch in (1, 16):
            old, new = best[(name, batch, "0")], best[(name, batch, "1")]
            mid = len(old) // 2
            print(f"{name} batch {batch:2d}: torch {min(old) * 1e3:.2f} ms/step (median {sorted(old)[mid] * 1e3:.2f}), "
                  f"native {min(new) * 1e3:.2f} (median {sorted(new)[mid] * 1e3:.2f}): {min(old) / min(new):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", action="store_true", help="whole engine steps instead of one layer's attention")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    if args.engine:
        engines(args.rounds)
    else:
        with torch.inference_mode():
            per_call(args.rounds, args.calls)


if __name__ == "__main__":
    main()
