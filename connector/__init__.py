"""sparse-kv-connector: a vLLM KV connector that streams the main KV cache and the sparse-attention index
K/V sub-pools from prefill to decode per layer over NIXL, for any PP/TP layout on each side.

A package imports only itself and the packages listed above it, and never the lab (sparse_kv_lab: the simulated
ranks, the real-engine launcher, the soak and the demo/bench commands, installed beside it); only vllm/ imports
vllm, only transport/nixl/ imports nixl (tests/test_layers.py holds this). Each package's `__init__`
lists its modules the same way (tests/test_module_lists.py).

  core/           the pure model: layouts, plans, descriptors, errors (no I/O, no torch, no asyncio)
  protocol/       what crosses the wire, and the pure checks on it
  transport/      sockets, threads, NIXL, device copies
  engine/         one rank, framework-agnostic asyncio: the sender (prefill) and the receiver (decode)
  vllm/           the vLLM 0.33 adapter: the only package that imports vllm
  cli/            `python -m connector ...`: the thin front end (demo, bench, bench-pd, serve-local: the lab's)
  __main__        `python -m connector`"""

__version__ = "0.1.0"


def register() -> None:
    """Register `SparseKVConnector` with vLLM's KVConnectorFactory (idempotent).

    Also the `vllm.general_plugins` entry point, so an installed package works by name alone."""
    from connector.vllm import register as _register  # vllm is imported only here, lazily

    _register()
