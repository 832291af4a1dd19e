"""Where a model or adapter comes from, and the volumes and init containers that put it in the pod.

pvc://CLAIM/PATH   the claim, mounted read-only (subPath PATH): nothing is copied.
hf://ORG/NAME@REV  fetched by an init container (`hf download`, the engine image) into an emptyDir.
s3://BUCKET/PATH   fetched by an init container (`aws s3 sync`) into an emptyDir.
file:///PATH       a directory on the node (hostPath, read-only), only under a prefix the operator's
                   policy allows (policy.py; none by default). Meant for single-node dev clusters and
                   nodes with pre-staged weights; Pod Security "baseline" forbids hostPath, so such
                   pods are refused by admission there, which the Degraded condition reports.
"""
from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from kubeinfer.operator.credentials import fetch_env
from kubeinfer.operator.names import ADAPTERS_DIR, MODEL_DIR

CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
HF_PART = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
HF_REVISION = re.compile(r"^[A-Za-z0-9._/-]+$")
BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
SCHEMES = ("pvc", "hf", "s3", "file")
# The fetch containers' own settings, after spec.engine.env (one entry per name: server-side apply refuses
# duplicates). The root filesystem is read-only: tools keep their caches and config under /tmp. The engine
# image sets HF_HUB_OFFLINE=1 for serving; the fetch is the one place that must go online. Plain text (no
# colours): a failed fetch's log tail becomes the model's condition message.
FETCH_ENV = ({"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/hf"},
             {"name": "HF_HUB_OFFLINE", "value": "0"}, {"name": "NO_COLOR", "value": "1"},
             {"name": "TERM", "value": "dumb"})
FETCH_ENV_NAMES = frozenset(item["name"] for item in FETCH_ENV)


class SourceError(ValueError):
    pass


@dataclass(frozen=True)
class Source:
    uri: str
    scheme: str
    location: str  # claim, repo id, bucket or host directory
    path: str = ""  # inside the claim or bucket
    revision: str | None = None

    @property
    def fetched(self) -> bool:
        return self.scheme in ("hf", "s3")


def _clean_path(path: str, uri: str) -> str:
    if any(part == ".." for part in path.split("/")):
        raise SourceError(f"{uri!r} must not contain '..'")
    return posixpath.normpath(path).lstrip("/") if path.strip("/") else ""


def parse_source(uri: Any) -> Source:
    """Parse pvc:// hf:// s3:// file:// URIs; the error says what a valid one looks like."""
    if not isinstance(uri, str) or "://" not in uri:
        raise SourceError(f"{uri!r} is not a URI: use pvc://CLAIM/PATH, hf://ORG/NAME, s3://BUCKET/PATH or "
                          "file:///PATH")
    scheme, rest = uri.split("://", 1)
    if scheme not in SCHEMES:
        raise SourceError(f"{uri!r}: scheme {scheme!r} is not supported (use {', '.join(SCHEMES)})")
    if scheme == "file":
        if not rest.startswith("/") or rest.strip("/") == "":
            raise SourceError(f"{uri!r} must be file:///ABSOLUTE/DIRECTORY (three slashes, not the root)")
        return Source(uri, scheme, "/" + _clean_path(rest, uri))
    location, _, path = rest.partition("/")
    if scheme == "pvc":
        if not CLAIM.match(location) or len(location) > 253:
            raise SourceError(f"{uri!r}: {location!r} is not a valid PersistentVolumeClaim name")
        return Source(uri, scheme, location, _clean_path(path, uri))
    if scheme == "s3":
        if not BUCKET.match(location):
            raise SourceError(f"{uri!r}: {location!r} is not a valid S3 bucket name")
        return Source(uri, scheme, location, _clean_path(path, uri))
    repo, _, revision = rest.partition("@")
    parts = repo.split("/")
    if not 1 <= len(parts) <= 2 or not all(HF_PART.match(p) and len(p) <= 96 for p in parts):
        raise SourceError(f"{uri!r} must be hf://ORG/NAME or hf://ORG/NAME@REVISION")
    if revision and not HF_REVISION.match(revision):
        raise SourceError(f"{uri!r}: revision {revision!r} is not a branch, tag or commit")
    return Source(uri, scheme, repo, revision=revision or None)


@dataclass(frozen=True)
class FetchContext:
    """What init containers share with the engine container."""
    engine_image: str
    hf_image: str
    s3_image: str
    env: tuple[dict[str, Any], ...]
    security_context: dict[str, Any]


@dataclass
class Staging:
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)  # the engine container's
    init_containers: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, other: Staging) -> Staging:
        self.volumes += other.volumes
        self.mounts += other.mounts
        self.init_containers += other.init_containers
        return self


def fetch_container(name: str, source: Source, dest: str, cache_volume: str, cache_root: str,
                    ctx: FetchContext) -> dict[str, Any]:
    if source.scheme == "hf":
        image = ctx.hf_image or ctx.engine_image
        command = ["hf", "download", source.location, "--local-dir", dest]
        command += ["--revision", source.revision] if source.revision else []
    else:
        image = ctx.s3_image
        command = ["aws", "s3", "sync", f"s3://{source.location}/{source.path}".rstrip("/"), dest,
                   "--only-show-errors"]
    env = [item for item in fetch_env(source.scheme, ctx.env) if item.get("name") not in FETCH_ENV_NAMES]
    env += [dict(item) for item in FETCH_ENV]
    return {"name": name, "image": image, "command": command, "env": env,
            "securityContext": ctx.security_context,
            "volumeMounts": [{"name": cache_volume, "mountPath": cache_root}, {"name": "tmp", "mountPath": "/tmp"}]}


def stage_model(source: Source, ctx: FetchContext) -> Staging:
    """The model directory appears read-only at MODEL_DIR in the engine container."""
    root = posixpath.dirname(MODEL_DIR)
    if source.scheme == "pvc":
        mount = {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
        return Staging([{"name": "model", "persistentVolumeClaim": {"claimName": source.location, "readOnly": True}}],
                       [{**mount, "subPath": source.path} if source.path else mount])
    if source.scheme == "file":
        return Staging([{"name": "model", "hostPath": {"path": source.location, "type": "Directory"}}],
                       [{"name": "model", "mountPath": MODEL_DIR, "readOnly": True}])
    return Staging([{"name": "model-cache", "emptyDir": {}}],
                   [{"name": "model-cache", "mountPath": root, "readOnly": True}],
                   [fetch_container("fetch-model", source, MODEL_DIR, "model-cache", root, ctx)])


def stage_adapters(adapters: list[tuple[str, Source]], ctx: FetchContext,
                   claims: dict[str, str] | None = None) -> Staging:
    """Every adapter appears read-only at ADAPTERS_DIR/<name>, the engine's --lora-catalog-dir.

    Each adapter is its own mount; none sits inside another read-only mount (the runtime cannot create a
    mount point in a read-only directory). `claims` maps claims the pod already mounts (the model's) to their
    volume: one volume per claim, or the kubelet waits for good on the second.
    """
    if not adapters:
        return Staging()
    staging = Staging()
    claims = dict(claims or {})
    for i, (name, source) in enumerate(adapters):
        dest = f"{ADAPTERS_DIR}/{name}"
        if source.fetched:
            if not staging.init_containers:
                staging.volumes.append({"name": "adapter-cache", "emptyDir": {}})
            staging.init_containers.append(
                fetch_container(f"fetch-adapter-{i}", source, dest, "adapter-cache", ADAPTERS_DIR, ctx))
            staging.mounts.append({"name": "adapter-cache", "mountPath": dest, "readOnly": True, "subPath": name})
            continue
        if source.scheme == "pvc":
            if source.location not in claims:  # one volume per claim, however many adapters it holds
                claims[source.location] = volume = f"adapter-pvc-{i}"
                staging.volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": source.location,
                                                                                  "readOnly": True}})
            mount = {"name": claims[source.location], "mountPath": dest, "readOnly": True}
            staging.mounts.append({**mount, "subPath": source.path} if source.path else mount)
        else:
            staging.volumes.append({"name": f"adapter-host-{i}",
                                    "hostPath": {"path": source.location, "type": "Directory"}})
            staging.mounts.append({"name": f"adapter-host-{i}", "mountPath": dest, "readOnly": True})
    return staging
