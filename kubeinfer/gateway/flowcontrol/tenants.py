"""Who is calling: the tenants file (`--tenants FILE`) and the lookup of a request's tenant.

    tenants:
      - name: team-a
        apiKeys: [KEY, ...]            # or apiKeySha256: [HEX, ...] (keys never need to sit in clear text)
        requestsPerSecond: 5           # each limit optional; absent: unlimited
        tokensPerMinute: 20000         # prompt + completion tokens
        maxConcurrency: 8
        weight: 2                      # fair share under saturation (default 1)
    defaultTenant: {name: anonymous, requestsPerSecond: 1}   # optional; without it an unknown key is a 401

A request's tenant comes from `Authorization: Bearer KEY` (compared by SHA-256, so plain and hashed
keys are one table), or, with `--trust-tenant-header`, from `x-gateway-tenant` naming a tenant (a proxy
in front has authenticated the caller). The file is re-read when its modification time or size changes
(a Secret update reaches the pod as a new file); a file that no longer parses keeps the last good one.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import yaml

from ..scheduling.picker import RoutingError

logger = logging.getLogger(__name__)
TENANT_HEADER = "x-gateway-tenant"
RELOAD_CHECK_SECONDS = 1.0  # a stat per second at most, not one per request


class TenantFileError(ValueError):
    pass


@dataclass(frozen=True)
class Tenant:
    name: str
    requests_per_second: float | None = None
    tokens_per_minute: float | None = None
    max_concurrency: int | None = None
    weight: float = 1.0
    key_hashes: frozenset[str] = frozenset()  # sha256 hex of each API key


@dataclass
class Tenants:
    by_name: dict[str, Tenant] = field(default_factory=dict)
    by_key_hash: dict[str, Tenant] = field(default_factory=dict)
    default: Tenant | None = None

    def names(self) -> set[str]:
        return set(self.by_name) | ({self.default.name} if self.default else set())


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _limit(entry: dict, key: str, kind, where: str):
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise TenantFileError(f"{where}: {key} must be a positive number, got {value!r}")
    return kind(value)


def _tenant(entry, where: str) -> Tenant:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
        raise TenantFileError(f"{where}: each tenant needs a name")
    where = f"{where} {entry['name']!r}"
    unknown = set(entry) - {"name", "apiKeys", "apiKeySha256", "requestsPerSecond", "tokensPerMinute",
                            "maxConcurrency", "weight"}
    if unknown:
        raise TenantFileError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    hashes = {key_hash(str(k)) for k in entry.get("apiKeys") or []}
    for digest in entry.get("apiKeySha256") or []:
        digest = str(digest).lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise TenantFileError(f"{where}: apiKeySha256 entries are 64 hex digits")
        hashes.add(digest)
    return Tenant(name=entry["name"], requests_per_second=_limit(entry, "requestsPerSecond", float, where),
                  tokens_per_minute=_limit(entry, "tokensPerMinute", float, where),
                  max_concurrency=_limit(entry, "maxConcurrency", int, where),
                  weight=_limit(entry, "weight", float, where) or 1.0, key_hashes=frozenset(hashes))


def parse_tenants(document) -> Tenants:
    if not isinstance(document, dict) or not isinstance(document.get("tenants", []), list):
        raise TenantFileError("the tenants file is a mapping with a `tenants` list")
    tenants = Tenants()
    for entry in document.get("tenants") or []:
        tenant = _tenant(entry, "tenant")
        if tenant.name in tenants.by_name:
            raise TenantFileError(f"tenant {tenant.name!r} is listed twice")
        tenants.by_name[tenant.name] = tenant
        for digest in tenant.key_hashes:
            if digest in tenants.by_key_hash:
                raise TenantFileError(f"an API key of {tenant.name!r} also belongs to "
                                      f"{tenants.by_key_hash[digest].name!r}")
            tenants.by_key_hash[digest] = tenant
    if document.get("defaultTenant") is not None:
        tenants.default = _tenant(document["defaultTenant"], "defaultTenant")
        if tenants.default.name in tenants.by_name:
            raise TenantFileError(f"defaultTenant {tenants.default.name!r} has the name of a listed tenant")
    return tenants


def load_tenants(path: str) -> Tenants:
    try:
        with open(path) as file:
            return parse_tenants(yaml.safe_load(file) or {})
    except (OSError, yaml.YAMLError) as error:
        raise TenantFileError(f"cannot read tenants file {path}: {error}") from None


def bearer_key(headers: Mapping[str, str]) -> str | None:
    scheme, _, key = (headers.get("authorization") or "").strip().partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


class TenantDirectory:
    """The current tenants, re-read from `path` when it changes."""

    def __init__(self, path: str, trust_header: bool = False, clock=time.monotonic) -> None:
        self.path, self.trust_header, self.clock = path, trust_header, clock
        self.tenants = load_tenants(path)  # a broken file at start is fatal: the CLI reports it
        self._signature = self._stat()
        self._checked = clock()

    def _stat(self):
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size, stat.st_ino

    def current(self) -> Tenants:
        now = self.clock()
        if now - self._checked >= RELOAD_CHECK_SECONDS:
            self._checked = now
            self.reload_if_changed()
        return self.tenants

    def reload_if_changed(self) -> bool:
        signature = self._stat()
        if signature is None or signature == self._signature:
            return False
        self._signature = signature
        try:
            self.tenants = load_tenants(self.path)
        except TenantFileError as error:
            logger.error("keeping the previous tenants: %s", error)
            return False
        logger.info("tenants reloaded from %s: %d tenants", self.path, len(self.tenants.by_name))
        return True

    def identify(self, headers: Mapping[str, str]) -> Tenant:
        """The request's tenant; RoutingError(401) in OpenAI's shape when none matches and there is no
        default tenant."""
        tenants = self.current()
        if self.trust_header and headers.get(TENANT_HEADER):
            tenant = tenants.by_name.get(headers[TENANT_HEADER])
            if tenant is not None:
                return tenant
        key = bearer_key(headers)
        tenant = tenants.by_key_hash.get(key_hash(key)) if key else None
        if tenant is not None:
            return tenant
        if tenants.default is not None:
            return tenants.default
        if key is None:
            raise RoutingError(401, "You didn't provide an API key. Pass it in the Authorization header "
                                    "(Authorization: Bearer YOUR_KEY).")
        raise RoutingError(401, "Incorrect API key provided.")
