"""Scheduler side (runs in vLLM's EngineCore process): routes each request to the half of its role. Pure
bookkeeping, no I/O.

  kv_producer  PrefillScheduler (connector.vllm.prefill_side): requests with `do_remote_decode` send
  kv_consumer  DecodeScheduler (connector.vllm.decode_side): requests with `do_remote_prefill` load
  kv_both      both: each request is prefill or decode by its own kv_transfer_params, as vLLM's NixlConnector
               does (vLLM 0.33 still accepts kv_both for it, with a deprecation warning, and many launch scripts
               use it)"""

from __future__ import annotations

import logging
from typing import Any

from connector.core.errors import LayoutError
from connector.vllm.config import ConnectorSettings, role_halves
from connector.vllm.decode_side import DecodeScheduler
from connector.vllm.metadata import SparseKVHandshake, SparseKVMetadata
from connector.vllm.prefill_side import PrefillScheduler
from connector.vllm.requests import ROUTER_HINT, check_params  # noqa: F401 - re-exported (tests, callers)

log = logging.getLogger(__name__)

class SchedulerSide:
    def __init__(self, kv_role: str, engine_id: str, settings: ConnectorSettings | None = None,
                 dp_index: int = 0) -> None:
        sends, receives = role_halves(kv_role)
        self.kv_role = kv_role
        self.engine_id = engine_id
        self.settings = settings or ConnectorSettings()
        self.prefill = PrefillScheduler(engine_id, self.settings, dp_index) if sends else None
        self.decode = DecodeScheduler() if receives else None
        self.handshakes: dict[tuple[int, int], SparseKVHandshake] = {}

    @property
    def is_producer(self) -> bool:
        """Only prefill (kv_producer): no request of this engine loads KV."""
        return self.decode is None

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        for half in (self.prefill, self.decode):
            if half is not None:
                half.kv_cache_manager = kv_cache_manager

    # ---- matching and allocation ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if self.prefill is not None and params.get("do_remote_decode"):
            self.prefill.match(request, params)
            return 0, False
        if self.decode is not None and params.get("do_remote_prefill"):
            return self.decode.match(request, num_computed_tokens)
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.decode is not None and num_external_tokens > 0:
            self.decode.allocated(request, blocks, num_external_tokens)

    @staticmethod
    def transfer_id_of(request: Any) -> str:
        return PrefillScheduler.transfer_id_of(request)

    def side_channel_addr(self) -> str:
        """host:port decode connects to (a prefill-capable engine's rank (pp0, tp0))."""
        if self.prefill is None:
            return ""
        return self.prefill.side_channel_addr()

    # ---- per step ---------------------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> SparseKVMetadata:
        meta = SparseKVMetadata()
        if self.decode is not None:
            self.decode.fill(meta)
            meta.aborts.update(self.decode.aborts)
            self.decode.aborts = {}
        if self.prefill is not None:
            meta.aborts.update(self.prefill.aborts)
            self.prefill.aborts = {}
            self.prefill.fill(meta, scheduler_output)
        return meta

    def update_connector_output(self, output: Any) -> None:
        if self.prefill is not None:
            for req_id in output.finished_sending or ():
                self.prefill.sent(req_id)
        if self.decode is not None:
            for req_id in output.finished_recving or ():
                self.decode.received(req_id)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        if self.prefill is not None and self.prefill.owns(request.request_id):
            return self.prefill.finished(request)
        if self.decode is not None:
            self.decode.finished(request)
        return False, None

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while prefill holds blocks for decode, so completions are collected."""
        return any(half is not None and half.pending() for half in (self.prefill, self.decode))

    def set_handshakes(self, metadata: dict[tuple[int, int], Any]) -> None:
        """All (pp, tp) ranks, PP > 0 included. They must agree on the model fingerprint."""
        prints = {k: getattr(v, "fingerprint", None) for k, v in metadata.items()}
        if len(set(prints.values())) > 1:
            raise LayoutError(f"SparseKVConnector workers disagree on the model layout fingerprint: {prints}")
        self.handshakes = dict(metadata)
        first = metadata.get((0, 0))
        if self.prefill is not None and getattr(first, "side_channel_addr", ""):
            self.prefill.side_channel_reported = first.side_channel_addr
        for (pp, tp), hs in sorted(metadata.items()):
            if getattr(hs, "side_channel_addr", ""):
                log.info("SparseKVConnector prefill rank pp%d,tp%d side channel %s", pp, tp, hs.side_channel_addr)
