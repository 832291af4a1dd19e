# kubeinfer engine, CPU only: `kubeinfer serve MODEL_DIR ...` (the operator sets the arguments).
# Build from the repository root:  docker build -f docker/engine-cpu.Dockerfile -t kubeinfer/engine:cpu .
FROM python:3.11.11-slim-bookworm AS build
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kubeinfer
ENV PATH=/opt/kubeinfer/bin:$PATH
# The CPU wheel first, so `pip install .` finds torch satisfied and never pulls the CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md /src/
COPY kubeinfer /src/kubeinfer
RUN pip install /src

FROM python:3.11.11-slim-bookworm
RUN groupadd --gid 1000 kubeinfer && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin kubeinfer
COPY --from=build /opt/kubeinfer /opt/kubeinfer
# HOME and caches under /tmp: pods run with a read-only root filesystem and an emptyDir on /tmp.
ENV PATH=/opt/kubeinfer/bin:$PATH HOME=/tmp PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# OpenBLAS's idle workers sleep after 2**4 cycles instead of spinning ~0.1 s: quantized models' small steps then
# share the cores (kubeinfer/engine/platforms/cpu/two_cores.py; float32 decode measured no slower).
ENV OPENBLAS_THREAD_TIMEOUT=4
# No C compiler in this image: the native VNNI kernels (engine/platforms/cpu/native, built with -march=native
# on the node that runs them) are not built here, and the engine says so once and uses torch's kernels
# (W8A8 through torch._int_mm). An image for one CPU family could add gcc and run
# `python -m kubeinfer.engine.platforms.cpu.native.build` at start.
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000 8001
ENTRYPOINT ["kubeinfer"]
CMD ["serve", "--help"]
