#!/bin/bash
# Downloads into .whl/ the wheels the GPU image lacks (CPython 3.12, manylinux x86-64), at the versions of this
# checkout's .venv, for scripts/gpu-check.sh to install there (that machine reaches no registry).
# The image has torch, triton, transformers, safetensors, tokenizers, anyio, h11, idna, certifi, psutil, pytest,
# pytest-xdist and pytest-timeout (docs/gpu.md); this list is what kubeinfer and its GPU tests import beyond them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=.whl
PACKAGES=(
  fastapi starlette pydantic pydantic_core annotated-types annotated-doc typing-inspection uvicorn msgspec pyzmq
  llguidance pytest-asyncio opentelemetry-api
  openai distro jiter sniffio httpx2 httpcore2 truststore  # openai (tests/engine/test_engine_deferred_text.py)
  compressed-tensors loguru                                   # the quantized-checkpoint tests' reference
)
# pip matches a manylinux_2_N tag exactly: every N up to the image's glibc (2.39: Ubuntu 24.04's)
PLATFORMS=($(for n in $(seq 39 -1 5); do echo manylinux_2_${n}_x86_64; done) manylinux2014_x86_64 manylinux1_x86_64)

mkdir -p "$DEST"
grep -qx '/.whl/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null ||
  echo '/.whl/' >> "$(git rev-parse --git-common-dir)/info/exclude"
rm -f "$DEST"/*.whl  # one version of each: two stop the install there
for name in "${PACKAGES[@]}"; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d "$DEST" "$name==$version"
done
ls "$DEST"
du -sh "$DEST"
