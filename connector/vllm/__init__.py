"""vLLM 0.33 adapter: the only package that imports vllm.

`kv_connector_module_path="connector.vllm"` loads `SparseKVConnector` from here; `register()` (also the
`vllm.general_plugins` entry point) makes the bare name work: `--kv-transfer-config '{"kv_connector":
"SparseKVConnector", "kv_role": "kv_producer", ...}'`. Either way vLLM looks the class up here, through this
module's `__getattr__`, which first checks the configuration being looked up (connector.vllm.early): that lookup
happens while vLLM builds its VllmConfig, before any model is loaded. Importing this package imports no vllm."""

import logging
import sys
from typing import Any

from connector.vllm.logs import adopt_vllm_logging

adopt_vllm_logging()  # every process that loads the connector: API server, engine core, workers

CONNECTOR_NAME = "SparseKVConnector"


def __getattr__(name: str) -> Any:
    """`SparseKVConnector`, imported when first asked for (vLLM's loader does `getattr(module, name)`), so that
    reading the settings (`connector.vllm.config`) does not import vllm and torch (some 10 s here); and before it is
    handed out, the configuration of whoever asks is checked (vLLM's KVConnectorFactory.get_connector_class,
    directly or through its loader: connector.vllm.early)."""
    if name != CONNECTOR_NAME:  # before any import: `from connector.vllm import worker` asks here first
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from connector.vllm.connector import SparseKVConnector
    from connector.vllm.early import check_on_lookup

    adopt_vllm_logging()  # (vllm has configured its logger by now, if it had not at the first call)
    check_on_lookup(sys._getframe(1))
    return SparseKVConnector


def register() -> None:
    """Register `SparseKVConnector` with vLLM's KVConnectorFactory. Idempotent (vLLM raises on a second
    registration of a name, so check first). The class is looked up from this package (see `__getattr__`)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "connector.vllm", CONNECTOR_NAME)
        logging.getLogger(__name__).info("registered SparseKVConnector with vLLM's KVConnectorFactory")


__all__ = ["SparseKVConnector", "register", "CONNECTOR_NAME"]
