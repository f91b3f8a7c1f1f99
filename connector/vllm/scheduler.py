"""Scheduler-side half (runs in vLLM's EngineCore process). Pure bookkeeping: it decides which requests transfer,
hands the workers their block ids every step through the metadata, and holds prefill blocks until every worker
reports the request finished sending. No I/O."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from vllm.v1.request import RequestStatus

from connector.core.errors import ConfigError, LayoutError
from connector.protocol.addressing import PrefillAddress
from connector.protocol.messages import MAX_TRANSFER_ID
from connector.vllm.config import ConnectorSettings, default_host
from connector.vllm.metadata import RecvSpec, SendSpec, SparseKVHandshake, SparseKVMetadata
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
"""is_producer -> (the key this role must not be asked, this role, the role that does it, what the router did)."""

ROUTER_HINT = "pass the kv_transfer_params of prefill's response to decode unchanged, or send both legs the " \
              "same transfer_id with prefill_addr on decode (examples/proxy.py)"


def check_params(params: dict[str, Any], *, decode: bool) -> str:
    """'' if the request's kv_transfer_params are usable, else a one-line reason naming the key and the fix.
    (Prefill accepts a missing transfer_id: it then makes one, see SchedulerSide.transfer_id_of.)"""
    given = sorted(params)
    if decode or "transfer_id" in params:
        tid = params.get("transfer_id")
        if not isinstance(tid, str) or not tid:
            what = "no transfer_id" if "transfer_id" not in params else f"an unusable transfer_id ({tid!r})"
            return f"kv_transfer_params has {what} (keys given: {given}): {ROUTER_HINT}"
        if len(tid) > MAX_TRANSFER_ID:
            return (f"kv_transfer_params transfer_id has {len(tid)} characters, more than the side channel's "
                    f"{MAX_TRANSFER_ID}: use a shorter id (a UUID)")
    if decode:
        if "prefill_addr" not in params:
            return f"kv_transfer_params has no prefill_addr (keys given: {given}): {ROUTER_HINT}"
        try:
            PrefillAddress.parse(params["prefill_addr"])
        except ConfigError as exc:
            return f"kv_transfer_params prefill_addr: {exc}"
    return ""


class SchedulerSide:
    def __init__(self, kv_role: str, engine_id: str, settings: ConnectorSettings | None = None) -> None:
        self.is_producer = kv_role == "kv_producer"
        self.engine_id = engine_id
        self.settings = settings or ConnectorSettings()
        self._side_channel_addr: str | None = None
        """host:port of prefill rank (pp0, tp0)'s side channel, as the workers reported it (else from settings)."""
        self._kv_cache_manager: Any = None
        # decode
        self._recv_ready: dict[str, RecvSpec] = {}      # to ship in the next metadata
        self._recv_waiting: dict[str, str] = {}         # request id -> transfer id, until finished_recving
        self._matched: dict[str, int] = {}              # request id -> local prefix hit when matched
        # prefill
        self._send_known: dict[str, tuple[str, int]] = {}   # request id -> (transfer id, prompt tokens)
        self._send_started: set[str] = set()            # shipped to the workers at least once
        self._send_held: set[str] = set()               # finished; blocks kept until finished_sending
        self._aborts: dict[str, str] = {}
        self.handshakes: dict[tuple[int, int], SparseKVHandshake] = {}
        self._mismatched: set[str] = set()
        """Requests whose kv_transfer_params ask for the other role (warned and counted once each)."""
        self._mismatch_logged_at = -ROLE_MISMATCH_LOG_EVERY_S
        self._mismatch_count = 0
        self._stats = SparseKVConnectorStats()
        """What the scheduler side observed since vLLM last asked (get_kv_connector_stats): role mismatches."""

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager

    # ---- matching and allocation ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        self._check_role(request, params)
        if self.is_producer:
            if params.get("do_remote_decode") and request.request_id not in self._send_known:
                problem = check_params(params, decode=False)
                if problem:
                    log.error("request %s: %s; it runs as a plain prefill and nothing is sent",
                              request.request_id, problem)
                else:
                    self._send_known[request.request_id] = (self.transfer_id_of(request),
                                                            request.num_prompt_tokens)
            return 0, False
        if not params.get("do_remote_prefill") or request.request_id in self._recv_waiting:
            return 0, False
        # vLLM must compute at least the last prompt token itself (it needs its logits), so that one is not loaded.
        count = request.num_prompt_tokens - 1 - num_computed_tokens
        if count <= 0:
            return 0, False
        self._matched[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.is_producer or num_external_tokens <= 0:
            return
        req_id = request.request_id
        params = request.kv_transfer_params or {}
        first = self._matched.pop(req_id, request.num_computed_tokens)
        block_ids = self._all_block_ids(req_id, blocks)
        problem = check_params(params, decode=True)
        self._recv_ready[req_id] = RecvSpec(
            transfer_id=str(params.get("transfer_id") or ""), prefill_addr=str(params.get("prefill_addr") or ""),
            block_ids=block_ids, first_token=first, num_tokens=first + num_external_tokens, error=problem,
            prefill_finished=bool(params.get("prefill_finished")))
        self._recv_waiting[req_id] = str(params.get("transfer_id") or "")
        # One transfer per request: if it fails and kv_load_failure_policy is "recompute", vLLM asks again and the
        # request must then be prefilled locally (as vLLM's NixlConnector does).
        if isinstance(request.kv_transfer_params, dict):
            request.kv_transfer_params["do_remote_prefill"] = False
        if problem:
            log.error("request %s: %s; failing it (kv_load_failure_policy applies)", req_id, problem)

    def _check_role(self, request: Any, params: dict[str, Any]) -> None:
        """A request that asks this engine for the other role's work runs as a plain request and moves no KV: say so
        (the deployment's roles or router URLs are swapped) and count it (`role_mismatches`)."""
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
                        "request(s) so far, counted in vllm:sparse_kv_role_mismatches_total)", request.request_id,
                        mine, key, theirs, routed, self._mismatch_count)

    def take_stats(self) -> SparseKVConnectorStats | None:
        """What happened since the last call, or None (vLLM then ships nothing)."""
        out, self._stats = self._stats, SparseKVConnectorStats()
        return None if out.is_empty() else out

    @staticmethod
    def transfer_id_of(request: Any) -> str:
        """The proxy's transfer_id (concurrent flow), or, when a router sent only `do_remote_decode` (the
        sequential flow of vLLM's proxy pattern), vLLM's own request id: unique among this engine's requests, and
        handed to the router in prefill's response."""
        tid = (request.kv_transfer_params or {}).get("transfer_id")
        return tid if isinstance(tid, str) and tid else str(request.request_id)

    def side_channel_addr(self) -> str:
        """host:port decode connects to: what prefill rank (pp0, tp0) reported, else the configured address."""
        if self._side_channel_addr:
            return self._side_channel_addr
        return f"{self.settings.side_channel_host or default_host()}:{self.settings.side_channel_port}"

    def _all_block_ids(self, req_id: str, blocks: Any) -> tuple[list[int], ...]:
        """Every block of the request per group, from token 0 (prefix hits included), as the workers index them
        by token."""
        if self._kv_cache_manager is not None:
            return tuple(list(g) for g in self._kv_cache_manager.get_block_ids(req_id))
        return tuple(list(g) for g in blocks.get_block_ids())

    # ---- per step ---------------------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> SparseKVMetadata:
        meta = SparseKVMetadata(recvs=self._recv_ready, aborts=self._aborts)
        self._recv_ready, self._aborts = {}, {}
        if self.is_producer and self._send_known:
            computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
            cached = scheduler_output.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens))
            for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
                known = self._send_known.get(req_id)
                if known is None or req_id not in computed:
                    continue
                tid, prompt = known
                meta.sends[req_id] = SendSpec(
                    transfer_id=tid, num_prompt_tokens=prompt, block_ids=self._all_block_ids(req_id, None),
                    computed_after_step=min(prompt, computed[req_id] + n_scheduled),
                    new=req_id not in self._send_started)
                self._send_started.add(req_id)
        return meta

    def update_connector_output(self, output: Any) -> None:
        for req_id in output.finished_sending or ():
            self._send_held.discard(req_id)
            self._send_known.pop(req_id, None)
            self._send_started.discard(req_id)
        for req_id in output.finished_recving or ():
            self._recv_waiting.pop(req_id, None)
            # vLLM finishes a failed load (policy "fail") before it shows us the output: no abort for it then.
            self._aborts.pop(req_id, None)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        params = request.kv_transfer_params or {}
        self._mismatched.discard(req_id)
        if self.is_producer:
            known = self._send_known.get(req_id)
            if known is None:
                return False, None
            if req_id not in self._send_started:  # never reached the workers: nothing reads its blocks
                self._send_known.pop(req_id, None)
                return False, None
            self._send_held.add(req_id)
            if request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
                # Aborted or failed prefill: tell decode, stop writing. Blocks are still held until the workers
                # report the transfer finished, so no WRITE in flight reads a reused block.
                self._aborts[req_id] = known[0]
                return True, None
            # What decode needs, in prefill's response: a router that copies kv_transfer_params into the decode
            # leg (vLLM's proxy pattern, llm-d) works unchanged. `prefill_finished` tells decode that this transfer
            # exists already, so a prefill that no longer knows it (restarted, lease gone) refuses at once.
            return True, {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": known[0],
                          "prefill_addr": self.side_channel_addr(), "prefill_engine_id": self.engine_id,
                          "prefill_finished": True, "lease_s": self.settings.lease_s}
        tid = self._recv_waiting.pop(req_id, None)
        self._matched.pop(req_id, None)
        if tid is not None:
            # Decode aborted while waiting (vLLM holds its blocks until the workers report it finished).
            spec = self._recv_ready.pop(req_id, None)
            if spec is not None:  # registration not shipped yet: workers only tell prefill to let go
                self._recv_ready[req_id] = dataclasses.replace(spec, aborted=True)
            else:  # workers stop waiting once every prefill rank confirmed it writes nothing more
                self._aborts[req_id] = tid
        elif params.get("do_remote_prefill") and not check_params(params, decode=True):
            # Finished (aborted, or a prompt too short to load anything) before its blocks were ever allocated, so
            # it never registered: prefill would keep the KV for its whole lease. Tell it to let go now.
            self._recv_ready[req_id] = RecvSpec(
                transfer_id=params["transfer_id"], prefill_addr=params["prefill_addr"], block_ids=(), first_token=0,
                num_tokens=0, aborted=True, finished=True)
        return False, None

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while prefill holds blocks for decode, so completions are collected."""
        return bool(self._send_held) or bool(self._aborts)

    def set_handshakes(self, metadata: dict[tuple[int, int], Any]) -> None:
        """All (pp, tp) ranks, PP > 0 included. They must agree on the model fingerprint."""
        prints = {k: getattr(v, "fingerprint", None) for k, v in metadata.items()}
        if len(set(prints.values())) > 1:
            raise LayoutError(f"SparseKVConnector workers disagree on the model layout fingerprint: {prints}")
        self.handshakes = dict(metadata)
        first = metadata.get((0, 0))
        if getattr(first, "side_channel_addr", ""):
            self._side_channel_addr = first.side_channel_addr
        for (pp, tp), hs in sorted(metadata.items()):
            if getattr(hs, "side_channel_addr", ""):
                log.info("SparseKVConnector prefill rank pp%d,tp%d side channel %s", pp, tp, hs.side_channel_addr)
