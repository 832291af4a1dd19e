#!/bin/bash
# The GPU session's one command (`make gpu-check`), sized for one device call of at most 10 minutes:
#   1. installs the wheels carried in .whl/ (scripts/gpu-wheels.sh; the GPU image reaches no registry) and
#      kubeinfer itself without dependencies (or, if pip refuses, links its subpackages in place);
#   2. runs the GPU tests (the Makefile's GPU_TESTS) with xdist in parallel on the one GPU: their CUDA engines
#      take a fixed KV cache (num_kv_blocks), so they share it;
#   3. runs tests/engine/test_kv_cache_sizing.py alone: it sizes engines from the GPU's free memory, which parallel
#      tests would change under it;
#   4. `make bench-gpu`.
# Everything goes under $OUT (default ./gpu-out): setup.log, test-gpu.log, fails.log and slow.log (written as
# each test ends, by tests/gpu_failure_log.py, so a run killed at its limit still tells), test-sizing.log,
# bench-gpu.log, RESULTS.md. Phase limits in seconds: TEST_S, SIZING_S, BENCH_S, COMPILE_S (0: skip).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${GPU_PYTHON:-python3}
WORKERS=${WORKERS:-12}
TEST_S=${TEST_S:-240} SIZING_S=${SIZING_S:-90} BENCH_S=${BENCH_S:-240} COMPILE_S=${COMPILE_S:-0}
PER_TEST_S=${PER_TEST_S:-200}
BENCH_GPU_ARGS=${BENCH_GPU_ARGS:---rate-requests 80}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GPU_LOG_DIR=$OUT
T0=$(date +%s)
say() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
summary() { grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed|errors?)\b" "$1" | cut -c1-240 | tail -"${2:-60}"; }

# -- 1. environment --------------------------------------------------------------------------------------
export PYTHONPATH=$PWD/tests${PYTHONPATH:+:$PYTHONPATH}  # the failure-log plugin
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/setup.log" 2>&1 || { say "installing .whl/ failed: see setup.log"; exit 1; }
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >> "$OUT/setup.log" 2>&1; then
  say "pip install -e . failed (setup.log); linking engine, gateway and operator under kubeinfer/ instead"
  for d in engine gateway operator; do ln -sfn "../$d" "kubeinfer/$d"; done
  export PYTHONPATH=$PWD:$PYTHONPATH
fi
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
"$PY" -c "import torch, triton, transformers, kubeinfer.engine.core.llm_engine; print('torch', torch.__version__,
'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tail -3
say "setup done"

# -- 2. the GPU tests, in parallel -----------------------------------------------------------------------
# One test file's list, the Makefile's; the sizing tests run alone below. The compile check for GPUs without
# one (ptxas on every kernel variant, minutes of CPU under 12 workers) runs here only with COMPILE_S > 0: CPU
# machines run it in `make test-all`, and here the CUDA tests compile what they launch for this GPU.
GPU_TESTS=${GPU_TESTS:-$(awk '/^GPU_TESTS :=/{on=1; sub(/^GPU_TESTS :=/, "")} on{more=/\\$/; sub(/\\$/, ""); print;
                              if (!more) exit}' Makefile)}
PARALLEL=$(for f in $GPU_TESTS; do [ "$f" = tests/engine/test_kv_cache_sizing.py ] || echo "$f"; done)
# OMP_NUM_THREADS=1: the transformers references run on the CPU, 12 workers x 16 threads thrashed 16 cores
OMP_NUM_THREADS=1 timeout -k 10 "$TEST_S" "$PY" -m pytest -q -rfEs --tb=short -n "$WORKERS" -p no:cacheprovider \
  -p gpu_failure_log --timeout "$PER_TEST_S" \
  --deselect tests/engine/test_triton_kernels.py::test_kernels_compile_for_gpus_without_one $PARALLEL \
  > "$OUT/test-gpu.log" 2>&1
say "parallel GPU tests: exit $?"; summary "$OUT/test-gpu.log"

# -- 3. what sizes engines from free memory, alone -------------------------------------------------------
timeout -k 10 "$SIZING_S" "$PY" -m pytest -q -rfEs --tb=short -p no:cacheprovider -p gpu_failure_log \
  --timeout "$SIZING_S" tests/engine/test_kv_cache_sizing.py > "$OUT/test-sizing.log" 2>&1
say "sizing tests: exit $?"; summary "$OUT/test-sizing.log" 10
if [ "$COMPILE_S" -gt 0 ]; then
  timeout -k 10 "$COMPILE_S" "$PY" -m pytest -q -rfEs -p no:cacheprovider -p gpu_failure_log \
    tests/engine/test_triton_kernels.py::test_kernels_compile_for_gpus_without_one > "$OUT/test-compile.log" 2>&1
  say "compile check: exit $?"; summary "$OUT/test-compile.log" 5
fi

# -- 4. the benchmark --------------------------------------------------------------------------------------
if command -v make > /dev/null; then
  timeout -k 10 "$BENCH_S" make --no-print-directory bench-gpu GPU_PYTHON="$PY" BENCH_GPU_ARGS="$BENCH_GPU_ARGS" \
    > "$OUT/bench-gpu.log" 2>&1
else
  timeout -k 10 "$BENCH_S" "$PY" benchmarks/bench_gpu.py $BENCH_GPU_ARGS > "$OUT/bench-gpu.log" 2>&1
fi
say "bench-gpu: exit $?"; grep -v -E "it/s\]|Loading|Writing" "$OUT/bench-gpu.log" | tail -25 | cut -c1-300
cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
