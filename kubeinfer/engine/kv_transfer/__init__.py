"""KV transfer: connectors to external KV tiers behind the device cache (vLLM's `--kv-transfer-config`)."""
from .base import KVConnectorBase, KVConnectorMetadata
from .config import KVTransferConfig, resolve_kv_transfer
from .registry import connector_factory, register_connector, served_connectors

__all__ = ["KVConnectorBase", "KVConnectorMetadata", "KVTransferConfig", "connector_factory", "register_connector",
           "resolve_kv_transfer", "served_connectors"]
