"""`DroppingSparseKVConnector`: SparseKVConnector on decode, plus one thing for the tests: when a transfer whose id
starts with `drop-<pool>-` has arrived, it zeroes that pool's rows in the request's blocks before vLLM learns the KV
is there. A decode that then generates other tokens than one engine shows the pool moved and was read; with any
other transfer id it is SparseKVConnector unchanged.

Loaded by `kv_connector_module_path: tests.sparse_model.dropping` with `kv_connector: DroppingSparseKVConnector`."""

from __future__ import annotations

from typing import Any

import torch

from connector.vllm.connector import SparseKVConnector
from connector.vllm.regions import classify_layers

POOLS = ("kv", "index_k", "index_v")


def dropped_pool(transfer_id: str) -> str | None:
    """`drop-index_k-<anything>` -> "index_k"; None for an ordinary transfer id."""
    for pool in POOLS:
        if transfer_id.startswith(f"drop-{pool}-"):
            return pool
    return None


class DroppingSparseKVConnector(SparseKVConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._layers = classify_layers(kv_cache_config) if kv_cache_config is not None else {}
        self._caches: dict[str, torch.Tensor] = {}
        self._drops: dict[str, tuple[str, list[list[int]], int]] = {}
        """Request id -> (pool, its block ids per group, first token received)."""
        self.dropped_rows = 0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._caches = dict(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        for req_id, spec in connector_metadata.recvs.items():
            pool = dropped_pool(spec.transfer_id)
            if pool is not None and not spec.finished and not spec.error:
                self._drops[req_id] = (pool, [list(g) for g in spec.block_ids], spec.first_token)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        for req_id in results.finished_recving or ():
            drop = self._drops.pop(req_id, None)
            if drop is not None and req_id not in (results.failed_recving or ()):
                self._zero(*drop)
        return results

    def _zero(self, pool: str, block_ids: list[list[int]], first_token: int) -> None:
        for name, info in self._layers.items():
            if info.pool != pool or name not in self._caches:
                continue
            cache = self._caches[name]
            blocks = block_ids[info.group][first_token // info.block_size:]
            cache[torch.tensor(blocks, dtype=torch.long)] = 0
            self.dropped_rows += len(blocks) * info.block_size
