"""Connectors by name, as `kv_connector` names them. Built-in ones are imported only when asked for."""
from __future__ import annotations

from collections.abc import Callable

from .base import KVConnectorBase

ConnectorFactory = Callable[..., KVConnectorBase]


def _offloading_connector(*args, **kwargs) -> KVConnectorBase:
    from .offloading import OffloadingConnector  # torch and the block manager: only when the tier is on

    return OffloadingConnector(*args, **kwargs)


_REGISTRY: dict[str, ConnectorFactory] = {"OffloadingConnector": _offloading_connector}


def register_connector(name: str, factory: ConnectorFactory) -> None:
    """Serve another connector under `name` (called with the config, the block size and the cache's shape)."""
    _REGISTRY[name] = factory


def served_connectors() -> list[str]:
    return sorted(_REGISTRY)


def connector_factory(name: str) -> ConnectorFactory:
    """The connector registered under `name`; ValueError naming the served ones."""
    if name not in _REGISTRY:
        raise ValueError(f"--kv-transfer-config: unknown kv_connector {name!r}; served: {served_connectors()}")
    return _REGISTRY[name]
