"""sparse-kv-connector: a vLLM KV connector that streams the main KV cache and the sparse-attention index
K/V sub-pools from prefill to decode per layer over NIXL, for any PP/TP layout on each side."""

__version__ = "0.1.0"


def register() -> None:
    """Register `SparseKVConnector` with vLLM's KVConnectorFactory (idempotent).

    Also the `vllm.general_plugins` entry point, so an installed package works by name alone."""
    from connector.vllm import register as _register  # vllm is imported only here, lazily

    _register()
