"""Scheduler side (runs in vLLM's EngineCore process): routes each request to the half of its role. Pure
bookkeeping, no I/O.

  kv_producer  PrefillScheduler (connector.vllm.prefill_side): requests with `do_remote_decode` send
  kv_consumer  DecodeScheduler (connector.vllm.decode_side): requests with `do_remote_prefill` load
  kv_both      both: each request is prefill or decode by its own kv_transfer_params, as vLLM's NixlConnector
               does (vLLM 0.33 still accepts kv_both for it, with a deprecation warning, and many launch scripts
               use it)"""

from __future__ import annotations

import logging
import time
from typing import Any

from connector.core.errors import LayoutError
from connector.core.untrusted import shown
from connector.protocol.auth import new_engine_key
from connector.vllm.config import ConnectorSettings, role_halves
from connector.vllm.decode_side import DecodeScheduler
from connector.vllm.idle_hold import HoldPacer
from connector.vllm.metadata import SparseKVHandshake, SparseKVMetadata
from connector.vllm.prefill_side import PrefillScheduler
from connector.vllm.requests import ROUTER_HINT, check_params  # noqa: F401 - re-exported (tests, callers)
from connector.vllm.stats import SparseKVConnectorStats

log = logging.getLogger(__name__)

ROLE_MISMATCH_LOG_EVERY_S = 60.0
"""A deployment with swapped roles sends every request wrong: one warning per this interval, with the count."""
MISMATCH = {
    True: ("do_remote_prefill", "kv_producer (prefill)", "kv_consumer (decode)", "its decode leg to a prefill engine "
           "(the router's decode URL points at prefill"),
    False: ("do_remote_decode", "kv_consumer (decode)", "kv_producer (prefill)", "its prefill leg to a decode engine "
            "(the router's prefill URL points at decode"),
}
"""is_producer -> (the key this role must not be asked, this role, the role that does it, what the router did).
A kv_both engine does both, so it has no mismatch."""


def state_backoff(kv_cache_config: Any) -> int:
    """Prompt tokens prefill must not compute: 1 when the model keeps a Mamba/GDN state or a DeepSeek-V4.1 sliding
    window with bounded replay. Decode loads all but the prompt's last token and computes that one itself
    (connector.vllm.decode_side); attention KV of the last token is rewritten the same, a ring slot too, but a
    recurrent state would take the token twice, and a bounded-replay window must be laid out for the token decode
    recomputes. So prefill stops one token short and sends h(N-1), as vLLM's NixlConnector does
    (nixl/base_scheduler.py `_prefill_backoff`)."""
    if kv_cache_config is None:
        return 0
    replay = any(getattr(g.kv_cache_spec, "prefix_replay_tokens", 0) > 0
                 for g in getattr(kv_cache_config, "kv_cache_groups", ()))
    return 1 if getattr(kv_cache_config, "has_mamba_layers", False) or replay else 0


def truncate_prompt(request: Any, backoff: int) -> None:
    """Drop the prompt's last `backoff` tokens on prefill (it computes the rest and samples one token that nobody
    reads: decode samples its own). Once per request, even when vLLM reschedules it."""
    params = request.kv_transfer_params
    if params.get("_sparse_kv_truncated") or request.num_prompt_tokens <= backoff \
            or request.prompt_token_ids is None:
        return
    del request.prompt_token_ids[-backoff:]
    del request._all_token_ids[-backoff:]
    request.num_prompt_tokens -= backoff
    request.max_tokens = 1
    params["_sparse_kv_truncated"] = True


class SchedulerSide:
    def __init__(self, kv_role: str, engine_id: str, settings: ConnectorSettings | None = None,
                 dp_index: int = 0, pacer: HoldPacer | None = None, backoff: int = 0) -> None:
        sends, receives = role_halves(kv_role)
        self.backoff = backoff
        """Prompt tokens prefill leaves uncomputed (`state_backoff`): 1 for a model with Mamba states."""
        self.kv_role = kv_role
        self.engine_id = engine_id
        self.settings = settings or ConnectorSettings()
        self.prefill = PrefillScheduler(engine_id, self.settings, dp_index) if sends else None
        self.decode = (DecodeScheduler(self.settings.log_timeline, tuple(self.settings.allowed_prefill_hosts))
                       if receives else None)
        self.handshakes: dict[tuple[int, int], SparseKVHandshake] = {}
        self.engine_key = new_engine_key() if receives else b""
        """Minted here, once per engine, where every rank's worker hears of it (the connector metadata): what
        prefill knows this decode engine by, besides its id (connector.protocol.auth.engine_name)."""
        self._mismatched: set[str] = set()
        """Requests whose kv_transfer_params ask for the other role (warned and counted once each)."""
        self._mismatch_logged_at = -ROLE_MISMATCH_LOG_EVERY_S
        self._mismatch_count = 0
        self._stats = SparseKVConnectorStats()
        """What the scheduler side observed since vLLM last asked (get_kv_connector_stats): role mismatches."""
        self.pacer = pacer or HoldPacer(None, 0.0)
        """Spaces out the empty steps of an engine that only holds KV for decode (connector.vllm.idle_hold)."""
        self._considered = False
        """vLLM tried to schedule a waiting request this step (it asks get_num_new_matched_tokens first): an empty
        step then means a request waits for blocks, which a send collected late would keep it waiting for."""

    @property
    def is_producer(self) -> bool:
        """Only prefill (kv_producer): no request of this engine loads KV."""
        return self.decode is None

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        for half in (self.prefill, self.decode):
            if half is not None:
                half.kv_cache_manager = kv_cache_manager

    # ---- matching and allocation ------------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params or {}
        if self.prefill is not None and self.backoff and params.get("do_remote_decode"):
            truncate_prompt(request, self.backoff)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self._considered = True
        params = request.kv_transfer_params or {}
        self._check_role(request, params)
        if self.prefill is not None and params.get("do_remote_decode"):
            self.prefill.match(request, params)
            return 0, False
        if self.decode is not None and params.get("do_remote_prefill"):
            return self.decode.match(request, num_computed_tokens)
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.decode is not None and num_external_tokens > 0:
            self.decode.allocated(request, blocks, num_external_tokens)

    def _check_role(self, request: Any, params: dict[str, Any]) -> None:
        """A request that asks this engine for the other role's work runs as a plain request and moves no KV: say so
        (the deployment's roles or router URLs are swapped) and count it (`role_mismatches`)."""
        if self.prefill is not None and self.decode is not None:
            return  # kv_both: either key is this engine's work
        key, mine, theirs, routed = MISMATCH[self.is_producer]
        if not params.get(key) or request.request_id in self._mismatched:
            return
        self._mismatched.add(request.request_id)
        self._mismatch_count += 1
        self._stats.add(role_mismatches=1)
        now = time.monotonic()
        if now - self._mismatch_logged_at >= ROLE_MISMATCH_LOG_EVERY_S:
            self._mismatch_logged_at = now
            log.warning("request %s asks this %s engine to %s, which only a %s engine does: the router sent %s, or "
                        "the two engines' kv_role are swapped); it runs as a plain request and no KV moves (%d such "
                        "request(s) so far, counted in vllm:sparse_kv_role_mismatches_total)",
                        shown(request.request_id), mine, key, theirs, routed, self._mismatch_count)

    def take_stats(self) -> SparseKVConnectorStats | None:
        """What happened since the last call, or None (vLLM then ships nothing)."""
        out, self._stats = self._stats, SparseKVConnectorStats()
        for half in (self.prefill, self.decode):
            if half is not None and half.samples:
                out.extend(**half.samples)
                half.samples = {}
        return None if out.is_empty() else out

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
        meta = SparseKVMetadata(engine_key=self.engine_key,
                                wake_addr=self.pacer.wake.name if self.pacer.wake is not None else "")
        if self.decode is not None:
            self.decode.scheduled(scheduler_output)
            self.decode.fill(meta)
            meta.aborts.update(self.decode.aborts)
            self.decode.aborts = {}
        if self.prefill is not None:
            meta.aborts.update(self.prefill.aborts)
            self.prefill.aborts = {}
            self.prefill.fill(meta, scheduler_output)
        considered, self._considered = self._considered, False
        pacing = None if considered else self._pacing(scheduler_output, meta)
        if pacing is not None:
            self.pacer.wait(**pacing)
        elif getattr(scheduler_output, "total_num_scheduled_tokens", 1):
            self.pacer.activity()  # traffic: the next quiet spell starts with short waits again
        return meta

    def _pacing(self, scheduler_output: Any, meta: SparseKVMetadata) -> dict[str, Any] | None:
        """The pacer's arguments for this step, or None: the step must not wait. It may when it computes and ships
        nothing and vLLM steps only to collect transfers: prefill holds KV for decode (its sends), or every decode
        request of ours is registered and waits for its KV (its receives; `kv_since` bounds that wait,
        connector.vllm.idle_hold.decode_wait_s). Never in the step that matches a request or ships its registration
        (a request arriving during a wait wakes it, and the next step registers it), nor in a step in which a
        waiting request could not be scheduled: it may wait for blocks a transfer is about to return."""
        if getattr(scheduler_output, "total_num_scheduled_tokens", 1) or meta.sends or meta.recvs or meta.aborts:
            return None
        kv_since = None
        if self.decode is not None and self.decode.waiting():
            kv_since = self.decode.only_waiting_since()
            if kv_since is None:
                return None  # a request being placed: vLLM's pace
        holding = self.prefill is not None and self.prefill.holding()
        if not holding and kv_since is None:
            return None
        return {"until": self.prefill.first_expiry() if holding else None, "kv_since": kv_since, "holding": holding}

    def update_connector_output(self, output: Any) -> None:
        if self.prefill is not None:
            for req_id in output.finished_sending or ():
                self.prefill.sent(req_id)
                self.pacer.activity()
        if self.decode is not None:
            for req_id in output.finished_recving or ():
                self.decode.received(req_id)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        self._mismatched.discard(request.request_id)
        if self.prefill is not None and self.prefill.owns(request.request_id):
            self.pacer.activity()
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
