"""KV transfer: connectors to external KV tiers behind the device cache (vLLM's `--kv-transfer-config`)."""
from .base import KVConnectorBase, KVConnectorMetadata, connector_factory, served_connectors
from .config import KVTransferConfig, resolve_kv_transfer

__all__ = ["KVConnectorBase", "KVConnectorMetadata", "KVTransferConfig", "connector_factory", "resolve_kv_transfer",
           "served_connectors"]
