# kubeinfer operator: kopf, watching InferenceModels. No torch: only the operator's own dependencies.
# Build from the repository root:  docker build -f docker/operator.Dockerfile -t kubeinfer/operator .
FROM python:3.11.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kubeinfer
ENV PATH=/opt/kubeinfer/bin:$PATH
RUN pip install "kopf>=1.45,<2" "aiohttp>=3.9" "httpx>=0.27" "prometheus-client>=0.20" "kubernetes>=30"
COPY pyproject.toml README.md /src/
COPY kubeinfer /src/kubeinfer
# --no-deps: the engine's dependencies (torch, transformers) are not needed to run the operator.
RUN pip install --no-deps /src

FROM python:3.11.11-slim-bookworm
RUN groupadd --gid 1000 kubeinfer && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin kubeinfer
COPY --from=build /opt/kubeinfer /opt/kubeinfer
ENV PATH=/opt/kubeinfer/bin:$PATH HOME=/tmp PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /tmp
EXPOSE 8080
# The module entry point imports nothing of the engine (the `kubeinfer` CLI may).
ENTRYPOINT ["python", "-m", "kubeinfer.operator.cli"]
