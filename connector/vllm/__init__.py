"""vLLM 0.33 adapter: the only package that imports vllm.

`kv_connector_module_path="connector.vllm"` loads `SparseKVConnector` from here; `register()` (also the
`vllm.general_plugins` entry point) makes the bare name work: `--kv-transfer-config '{"kv_connector":
"SparseKVConnector", "kv_role": "kv_producer", ...}'`. Either way vLLM looks the class up here, through this
module's `__getattr__`, which first checks the configuration being looked up (connector.vllm.early): that lookup
happens while vLLM builds its VllmConfig, before any model is loaded. Importing this package imports no vllm.

  connector       SparseKVConnector, the class vLLM instantiates: routes each call to the scheduler or worker half
  config          kv_connector_extra_config -> typed settings, and the engine and transport configs built from them
  early           mistakes in --kv-transfer-config refused before vLLM loads the model
  scheduler       the scheduler side (EngineCore): each request to the half of its role
  prefill_side    the scheduler's prefill half: which requests send, their blocks, when they are released
  decode_side     the scheduler's decode half: which requests load their prompt's KV, and when they are ready
  requests        what both halves read from a vLLM request (kv_transfer_params checked, block ids)
  metadata        what the scheduler side tells every worker each step
  idle_hold       holding and awaiting KV at little CPU: vLLM's empty steps spaced out
  worker          the worker side (one per GPU worker): vLLM's tensors -> regions, its hooks -> engine calls
  specs           the model's layout from the KV-cache specs vLLM built, not from an architecture table
  states          which Mamba/GDN states split over TP, from the layer modules' exact classes
  regions         which pool and global layer each KV-cache tensor is, as Regions
  token_layout    how the attention backend lays tokens out in a block, asked of its own cache-update kernel
  layer_signals   per-layer "KV written" signals for the attention layers vLLM never hooks
  stats           the transfer metrics on vLLM's KV-connector stats path (Prometheus counters, histograms)
  logs            the connector's log lines in vLLM's log, in vLLM's format"""

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
