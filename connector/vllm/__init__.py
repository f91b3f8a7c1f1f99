"""vLLM 0.33 adapter: the only package that imports vllm.

`kv_connector_module_path="connector.vllm"` loads `SparseKVConnector` from here; `register()` (also the
`vllm.general_plugins` entry point) makes the bare name work: `--kv-transfer-config '{"kv_connector":
"SparseKVConnector", "kv_role": "kv_producer", ...}'`."""

from connector.vllm.connector import SparseKVConnector

CONNECTOR_NAME = "SparseKVConnector"


def register() -> None:
    """Register `SparseKVConnector` with vLLM's KVConnectorFactory. Idempotent (vLLM raises on a second
    registration of a name, so check first)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "connector.vllm.connector", CONNECTOR_NAME)


__all__ = ["SparseKVConnector", "register", "CONNECTOR_NAME"]
