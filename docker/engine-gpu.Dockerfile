# kubeinfer engine for NVIDIA GPUs (CUDA torch wheel on a CUDA runtime base; the driver comes from the node).
# Build from the repository root:  docker build -f docker/engine-gpu.Dockerfile -t kubeinfer/engine:gpu .
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/kubeinfer
ENV PATH=/opt/kubeinfer/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md /src/
COPY kubeinfer /src/kubeinfer
RUN pip install /src

FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles a small C launcher the first time a kernel runs: it needs gcc and Python's headers.
RUN apt-get update && apt-get install -y --no-install-recommends python3 gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/* \
    && (userdel --remove ubuntu 2>/dev/null || true) \
    && groupadd --gid 1000 kubeinfer && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin kubeinfer
COPY --from=build /opt/kubeinfer /opt/kubeinfer
ENV PATH=/opt/kubeinfer/bin:$PATH HOME=/tmp PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    TRITON_CACHE_DIR=/tmp/triton
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000 8001
ENTRYPOINT ["kubeinfer"]
CMD ["serve", "--help"]
