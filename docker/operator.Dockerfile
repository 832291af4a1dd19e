# kubeinfer operator: kopf, watching InferenceModels. No torch: only the operator's own dependencies.
# Build from the repository root:  docker build -f docker/operator.Dockerfile -t kubeinfer/operator .
FROM python:3.11.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kubeinfer
ENV PATH=/opt/kubeinfer/bin:$PATH
COPY pyproject.toml README.md /src/
COPY docker/extra_requirements.py /src/docker/
# The `operator` extra of pyproject.toml (what kubeinfer/operator imports; tests/cli/test_extras.py), then the package
# without its own dependencies (torch, transformers: only the engine needs them).
RUN python /src/docker/extra_requirements.py /src/pyproject.toml operator > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt
COPY kubeinfer /src/kubeinfer
RUN pip install --no-deps /src

FROM python:3.11.11-slim-bookworm
# Every uid the chart runs has a user and a group (kopf calls getpass.getuser(), which needs one): 1000, the
# image's own, and 65532, which the chart's podSecurityContext sets (tests/chart/test_image_users.py).
RUN groupadd --gid 1000 kubeinfer \
    && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin kubeinfer \
    && groupadd --gid 65532 nonroot \
    && useradd --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin nonroot
COPY --from=build /opt/kubeinfer /opt/kubeinfer
ENV PATH=/opt/kubeinfer/bin:$PATH HOME=/tmp PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /tmp
EXPOSE 8080
# The module entry point imports nothing of the engine (the `kubeinfer` CLI may).
ENTRYPOINT ["python", "-m", "kubeinfer.operator.cli"]
