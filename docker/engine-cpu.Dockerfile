# kubeinfer engine, CPU only: `kubeinfer serve MODEL_DIR ...` (the operator sets the arguments).
# Build from the repository root:  docker build -f docker/engine-cpu.Dockerfile -t kubeinfer/engine:cpu .
# --build-arg TORCH_INDEX=URL: where the CPU torch wheel comes from (`make images TORCH_INDEX=...`), e.g. a mirror.
FROM python:3.11.11-slim-bookworm AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
# A C compiler in this stage only, for the native CPU kernels (below); the serving stage gets the built library.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/kubeinfer
ENV PATH=/opt/kubeinfer/bin:$PATH
# The CPU wheel first, so `pip install .` finds torch satisfied and never pulls the CUDA build.
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md /src/
COPY docker/extra_requirements.py /src/docker/
# The package's dependencies before its code: a change to kubeinfer/ rebuilds only the layers below.
RUN python /src/docker/extra_requirements.py /src/pyproject.toml --dependencies > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt
COPY kubeinfer /src/kubeinfer
RUN pip install --no-deps /src
# The native CPU kernels, one library per x86-64 level (v4, v3, portable), compiled into the installed package's
# platforms/cpu/native/prebuilt/ with a stamp of their sources: the engine loads the level of the node's CPU from
# there (it logs "native CPU paths: ..." at start), so the serving stage needs no compiler.
RUN KUBEINFER_CACHE_DIR=/tmp/kubeinfer-build python -m kubeinfer.engine.platforms.cpu.native.build --prebuild \
    && rm -rf /tmp/kubeinfer-build

FROM python:3.11.11-slim-bookworm
RUN groupadd --gid 1000 kubeinfer && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin kubeinfer
COPY --from=build /opt/kubeinfer /opt/kubeinfer
# HOME and caches under /tmp: pods run with a read-only root filesystem and an emptyDir on /tmp.
ENV PATH=/opt/kubeinfer/bin:$PATH HOME=/tmp PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# OpenBLAS's idle workers sleep after 2**4 cycles instead of spinning ~0.1 s: quantized models' small steps then
# share the cores (kubeinfer/engine/platforms/cpu/two_cores.py; float32 decode measured no slower).
ENV OPENBLAS_THREAD_TIMEOUT=4
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000 8001
ENTRYPOINT ["kubeinfer"]
CMD ["serve", "--help"]
