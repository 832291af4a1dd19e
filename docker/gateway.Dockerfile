# kubeinfer gateway (endpoint picker): HTTP proxy :8080, Envoy ext_proc gRPC :9002, metrics :9090. No torch.
# Build from the repository root:  docker build -f docker/gateway.Dockerfile -t kubeinfer/gateway .
FROM python:3.11.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kubeinfer
ENV PATH=/opt/kubeinfer/bin:$PATH
# The gateway's imports; keep in step with kubeinfer/gateway/ (a `gateway` extra in pyproject.toml would own this list).
RUN pip install "fastapi>=0.110" "uvicorn>=0.30" "httpx>=0.27" "prometheus-client>=0.20" "pydantic>=2.6" \
    "grpcio>=1.85.1" "grpcio-health-checking>=1.85.1" "protobuf>=7.35.1,<8" "xds-protos" "kubernetes>=30" \
    "pyzmq>=27" "msgpack>=1.0" "tokenizers>=0.21" "jinja2>=3"
COPY pyproject.toml README.md /src/
COPY kubeinfer /src/kubeinfer
RUN pip install --no-deps /src

FROM python:3.11.11-slim-bookworm
RUN groupadd --gid 1000 kubeinfer && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin kubeinfer
COPY --from=build /opt/kubeinfer /opt/kubeinfer
ENV PATH=/opt/kubeinfer/bin:$PATH HOME=/tmp PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /tmp
EXPOSE 8080 9002 9090
# Straight to the gateway's module: the `kubeinfer` CLI builds every subcommand's parser, and the
# engine's imports torch, which this image does not have.
ENTRYPOINT ["python", "-c", "import argparse, sys; from kubeinfer.gateway.cli import add_arguments, run; p = argparse.ArgumentParser(prog='kubeinfer gateway'); add_arguments(p); sys.exit(run(p.parse_args()))"]
CMD ["--port", "8080", "--ext-proc-port", "9002", "--metrics-port", "9090"]
