"""A vLLM worker extension (`--worker-extension-cls tests.sparse_model.worker_ext.PoolWiper`) for the tests: zero
one pool's caches on a worker, called over vLLM's dev-mode `/collective_rpc` (VLLM_SERVER_DEV_MODE=1), to show that
the forward reads what a pool holds."""

from __future__ import annotations

SUFFIXES = {"index_k": ".index_cache", "index_v": ".index_value_cache"}


class PoolWiper:
    def wipe_pool(self, pool: str) -> int:
        """Zero every cache of `pool` ("index_k" or "index_v") on this worker, all blocks; returns how many caches."""
        suffix = SUFFIXES[pool]
        context = self.vllm_config.compilation_config.static_forward_context  # self: vLLM's Worker
        wiped = 0
        for name, module in context.items():
            if name.endswith(suffix) and getattr(module, "kv_cache", None) is not None and module.kv_cache.numel():
                module.kv_cache.zero_()
                wiped += 1
        return wiped
