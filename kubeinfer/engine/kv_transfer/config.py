"""`--kv-transfer-config` and `--kv-offloading-size` / `--kv-offloading-backend`: vLLM's spellings of a KV
connector (an external tier the engine saves KV blocks to and loads them back from). No torch here: a bad
config is refused before any model work.

`--kv-offloading-backend native --kv-offloading-size GB` is vLLM's shorthand for
`{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config":
{"cpu_bytes_to_use": GB * 2**30}}`; giving both forms is refused (which one would win is not obvious).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import json_object_flag

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
OFFLOADING_BACKENDS = ("native",)  # vLLM also names "lmcache": not served here
GIB = 1 << 30


@dataclass
class KVTransferConfig:
    """vLLM's KVTransferConfig keys this engine reads. `kv_load_failure_policy`: recompute (the request
    computes what failed to load, counted) or fail (the request ends with the error)."""
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: str | dict | None) -> KVTransferConfig | None:
        """From a JSON string or dict; None when absent. ValueError naming what is wrong."""
        value = json_object_flag(value, "--kv-transfer-config")
        if value is None:
            return None
        known = ("kv_connector", "kv_role", "kv_connector_extra_config", "kv_load_failure_policy")
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"--kv-transfer-config: unknown or unsupported key(s) {unknown}; known: {list(known)}")
        if not isinstance(value.get("kv_connector"), str) or not value["kv_connector"]:
            raise ValueError("--kv-transfer-config: kv_connector (the connector's name) is required")
        config = cls(**value)
        if config.kv_role not in KV_ROLES:
            raise ValueError(f"--kv-transfer-config: kv_role must be one of {list(KV_ROLES)}, got {config.kv_role!r}")
        if config.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"--kv-transfer-config: kv_load_failure_policy must be one of "
                             f"{list(LOAD_FAILURE_POLICIES)}, got {config.kv_load_failure_policy!r}")
        if not isinstance(config.kv_connector_extra_config, dict):
            raise ValueError("--kv-transfer-config: kv_connector_extra_config must be a JSON object")
        return config


def resolve_kv_transfer(kv_transfer_config: str | dict | None, kv_offloading_size: float | None,
                        kv_offloading_backend: str | None) -> KVTransferConfig | None:
    """The connector config the flags describe (None: no external tier); ValueError on a bad or ambiguous one."""
    config = KVTransferConfig.parse(kv_transfer_config)
    if kv_offloading_size is None and kv_offloading_backend is None:
        return config
    if config is not None:
        raise ValueError("give either --kv-transfer-config or --kv-offloading-size/--kv-offloading-backend, not both")
    backend = kv_offloading_backend or "native"
    if backend not in OFFLOADING_BACKENDS:
        raise ValueError(f"--kv-offloading-backend {backend!r} is not served; served: {list(OFFLOADING_BACKENDS)}")
    if kv_offloading_size is None:
        raise ValueError("--kv-offloading-backend needs --kv-offloading-size (GiB of host memory for the tier)")
    if isinstance(kv_offloading_size, bool) or not isinstance(kv_offloading_size, (int, float)) \
            or kv_offloading_size <= 0:
        raise ValueError(f"--kv-offloading-size must be a positive number of GiB, got {kv_offloading_size!r}")
    return KVTransferConfig("OffloadingConnector", "kv_both",
                            {"cpu_bytes_to_use": int(kv_offloading_size * GIB)})
