"""vLLM 0.33 adapter: the only package that imports vllm.

`kv_connector_module_path="connector.vllm"` loads `SparseKVConnector` from here; `register()` (also the
`vllm.general_plugins` entry point) makes the bare name work: `--kv-transfer-config '{"kv_connector":
"SparseKVConnector", "kv_role": "kv_producer", ...}'`."""

import logging

from connector.vllm.connector import SparseKVConnector
from connector.vllm.logs import adopt_vllm_logging

adopt_vllm_logging()  # every process that loads the connector: API server, engine core, workers

CONNECTOR_NAME = "SparseKVConnector"


def register() -> None:
    """Register `SparseKVConnector` with vLLM's KVConnectorFactory. Idempotent (vLLM raises on a second
    registration of a name, so check first)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "connector.vllm.connector", CONNECTOR_NAME)
        logging.getLogger(__name__).info("registered SparseKVConnector with vLLM's KVConnectorFactory")


__all__ = ["SparseKVConnector", "register", "CONNECTOR_NAME"]
