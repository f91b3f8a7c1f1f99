"""`SparseKVConnector`: the class vLLM instantiates (once per role). It only routes vLLM's calls to the
scheduler-side or worker-side half."""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                 KVConnectorRole, KVConnectorTransferResults,
                                                                 SupportsHMA)

from connector.vllm.config import ConnectorSettings
from connector.vllm.early import check_found, check_role, check_transfer_config, configs_in_callers
from connector.vllm.idle_hold import pacer
from connector.vllm.metadata import SparseKVMetadata
from connector.vllm.scheduler import SchedulerSide, state_backoff
from connector.vllm.stats import SparseKVConnectorStats, SparseKVPromMetrics
from connector.vllm.worker import WorkerSide

log = logging.getLogger(__name__)

def kv_role_holding(extra_config: dict[str, Any]) -> str | None:
    """kv_role of the KVTransferConfig whose kv_connector_extra_config IS `extra_config` (this very dict), looked up
    in the callers' `self`. vLLM 0.33 asks requires_piecewise_for_cudagraph from VllmConfig.__post_init__
    (config/vllm.py:1990) with `self.kv_transfer_config.kv_connector_extra_config` alone; that VllmConfig holds the
    role. None when no caller within early.CALLER_FRAMES holds this dict (another caller, such as MultiConnector
    passing a child's config, or a copy)."""
    return getattr(configs_in_callers(sys._getframe(1), extra_config).ktc, "kv_role", None)


class SparseKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Streams the main KV cache and the sparse-attention index caches from prefill to decode per layer.

    kv_role: `kv_producer` on prefill, `kv_consumer` on decode, or `kv_both` (each request by its
    kv_transfer_params). Settings: `kv_connector_extra_config`
    (see ConnectorSettings). Request protocol: docs/internals.md, "kv_transfer_params: two flows"."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        check_role(ktc.kv_role)
        self.settings = ConnectorSettings.from_extra_config(ktc.kv_connector_extra_config)
        self.settings.check_trust(ktc.kv_role)
        self.engine_id = str(ktc.engine_id)
        dp_index = int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
        self._scheduler = (SchedulerSide(ktc.kv_role, self.engine_id, self.settings, dp_index,
                                         pacer(self.settings, vllm_config), state_backoff(kv_cache_config))
                           if role == KVConnectorRole.SCHEDULER else None)
        self._worker = (WorkerSide(vllm_config, kv_cache_config, self.settings, ktc.kv_role, self.engine_id)
                        if role == KVConnectorRole.WORKER else None)

    # ---- class-level ------------------------------------------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        if getattr(vllm_config, "kv_transfer_config", None) is not None:  # the engine core, before KV-cache sizing
            check_transfer_config(vllm_config.kv_transfer_config)
        # LBHNC (vLLM 0.33's KVCacheLayout): per layer, per block, heads outermost, so a head range of a block is
        # one contiguous run (needed to split heads when prefill and decode TP differ) and a block is one run.
        # MLA caches have one head: any layout works, keep vLLM's default.
        model_config = getattr(vllm_config, "model_config", None)
        if model_config is None or getattr(model_config, "use_mla", False):
            return None
        return "LBHNC"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Prefill signals each layer from Python (save_kv_layer, the methods connector.vllm.layer_signals installs);
        # a FULL graph replay runs none of it, so prefill needs PIECEWISE. Decode does nothing per layer and keeps
        # vLLM's FULL decode graphs. vLLM 0.33 passes only the extra config; when the role cannot be told, answer
        # as prefill (PIECEWISE is correct on both sides, only slower on decode). vLLM asks this while it builds the
        # VllmConfig, before anything loads: check the configuration here too (connector.vllm.early).
        found = configs_in_callers(sys._getframe(1), extra_config)
        check_found(found)
        return getattr(found.ktc, "kv_role", None) != "kv_consumer"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> SparseKVConnectorStats:
        return SparseKVConnectorStats(data=data) if data is not None else SparseKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> SparseKVPromMetrics:
        return SparseKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> SparseKVConnectorStats | None:
        # Worker: this step's transfer counters (vLLM sums the ranks). Scheduler: its own (role mismatches), which
        # vLLM 0.32 and 0.33 add to the workers' (Scheduler.make_stats).
        if self._worker is not None:
            return self._worker.take_stats()
        return self._scheduler.take_stats() if self._scheduler is not None else None

    # ---- scheduler side ---------------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # Decode loads the request's own blocks of every transferred group (vLLM 0.33 asks, to know whether a
        # DeepSeek-V4.1 sliding window came with the load or must be replayed); the base answers prefix-cacheable
        # groups only, as a hash-addressed store would.
        return tuple(self._kv_cache_config.transfer_group_ids)

    def on_new_request(self, request: Any) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return self._scheduler.request_finished(request)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._scheduler.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self._scheduler.has_pending_push_work()

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self._scheduler.set_handshakes(metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._scheduler.set_handshakes({(0, tp): md for tp, md in metadata.items()})

    # ---- worker side ------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> Any:
        return self._worker.handshake_metadata() if self._worker is not None and self._worker.transport else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, SparseKVMetadata)
        self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return  # receives start in bind_connector_metadata; decode's KV arrives between steps (async load)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # async load: the request is not scheduled until every layer has arrived

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        self._worker.step_done()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.transfer_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
