"""The decode half of the scheduler side (a `kv_consumer` engine, or a `kv_both` engine's decode requests): which
requests load their prompt's KV from prefill, the registration the workers send, and what to tell prefill when a
request ends before its KV arrived. No I/O."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from connector.core.untrusted import shown
from connector.engine.timeline import DecodeSchedulerPoints, close
from connector.vllm.metadata import RecvSpec, SparseKVMetadata
from connector.vllm.requests import all_block_ids, check_params

log = logging.getLogger(__name__)


def secret(params: dict[str, Any]) -> str:
    """The transfer's capability from decode's kv_transfer_params ('' for none; check_params vetted its type)."""
    value = params.get("transfer_secret")
    return value if isinstance(value, str) else ""


class DecodeScheduler:
    def __init__(self, log_timeline: bool = False, allowed_hosts: tuple[str, ...] = ()) -> None:
        self.allowed_hosts = allowed_hosts
        """allowed_prefill_hosts: the only hosts a request may send this decode to (empty: any)."""
        self.kv_cache_manager: Any = None
        self._ready: dict[str, RecvSpec] = {}      # to ship in the next metadata
        self._waiting: dict[str, str] = {}         # request id -> transfer id, until finished_recving
        self._registered_at: dict[str, float] = {}  # request id -> time.monotonic() its registration was made
        self._matched: dict[str, int] = {}         # request id -> local prefix hit when matched
        self.aborts: dict[str, str] = {}           # request id -> transfer id, for the next metadata
        self._learned: dict[str, tuple[str, DecodeSchedulerPoints]] = {}
        """Requests whose KV is in, until vLLM schedules them: (transfer id, timeline)."""
        self.samples: dict[str, list[float]] = {}
        """Stage samples since SchedulerSide.take_stats last drained them."""
        self._log_timeline = log_timeline

    def owns(self, req_id: str) -> bool:
        return req_id in self._waiting or req_id in self._matched

    def match(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """A request asking for `do_remote_prefill`: how many prompt tokens load from prefill (asynchronously)."""
        if request.request_id in self._waiting:
            return 0, False
        # vLLM must compute at least the last prompt token itself (it needs its logits), so that one is not loaded.
        count = request.num_prompt_tokens - 1 - num_computed_tokens
        if count <= 0:
            return 0, False
        self._matched[request.request_id] = num_computed_tokens
        return count, True

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        params = request.kv_transfer_params or {}
        first = self._matched.pop(req_id, request.num_computed_tokens)
        problem = check_params(params, decode=True, allowed_hosts=self.allowed_hosts)
        self._ready[req_id] = RecvSpec(
            transfer_id=str(params.get("transfer_id") or ""), prefill_addr=str(params.get("prefill_addr") or ""),
            block_ids=all_block_ids(self.kv_cache_manager, req_id, blocks), first_token=first,
            num_tokens=first + num_external_tokens, error=problem,
            prefill_finished=bool(params.get("prefill_finished")), transfer_secret=secret(params))
        self._waiting[req_id] = str(params.get("transfer_id") or "")
        self._registered_at[req_id] = time.monotonic()
        # One transfer per request: if it fails and kv_load_failure_policy is "recompute", vLLM asks again and the
        # request must then be prefilled locally (as vLLM's NixlConnector does).
        if isinstance(request.kv_transfer_params, dict):
            request.kv_transfer_params["do_remote_prefill"] = False
        if problem:
            log.error("request %s: %s; failing it (kv_load_failure_policy applies)", shown(req_id), problem)

    def fill(self, meta: SparseKVMetadata) -> None:
        meta.recvs.update(self._ready)
        self._ready = {}

    def received(self, req_id: str) -> None:
        tid = self._waiting.pop(req_id, None)
        self._registered_at.pop(req_id, None)
        if tid is not None:
            points = DecodeSchedulerPoints()
            points.mark("learned")
            self._learned[req_id] = (tid, points)
        # vLLM finishes a failed load (policy "fail") before it shows us the output: no abort for it then.
        self.aborts.pop(req_id, None)

    def scheduled(self, scheduler_output: Any) -> None:
        """Requests whose KV came in, scheduled this step: the end of decode's timeline of them."""
        if not self._learned:
            return
        for req_id in getattr(scheduler_output, "num_scheduled_tokens", None) or ():
            learned = self._learned.pop(req_id, None)
            if learned is None:
                continue
            tid, points = learned
            close(log, "decode_scheduler", tid, points, "scheduled", self._log_timeline, self.samples,
                  request_id=req_id)

    def finished(self, request: Any) -> None:
        req_id = request.request_id
        self._learned.pop(req_id, None)
        params = request.kv_transfer_params or {}
        tid = self._waiting.pop(req_id, None)
        self._registered_at.pop(req_id, None)
        self._matched.pop(req_id, None)
        if tid is not None:
            # Decode aborted while waiting (vLLM holds its blocks until the workers report it finished).
            spec = self._ready.pop(req_id, None)
            if spec is not None:  # registration not shipped yet: workers only tell prefill to let go
                self._ready[req_id] = dataclasses.replace(spec, aborted=True)
            else:  # workers stop waiting once every prefill rank confirmed it writes nothing more
                self.aborts[req_id] = tid
        elif params.get("do_remote_prefill") and not check_params(params, decode=True, allowed_hosts=self.allowed_hosts):
            # Finished (aborted, or a prompt too short to load anything) before its blocks were ever allocated, so
            # it never registered: prefill would keep the KV for its whole lease. Tell it to let go now.
            self._ready[req_id] = RecvSpec(
                transfer_id=params["transfer_id"], prefill_addr=params["prefill_addr"], block_ids=(), first_token=0,
                num_tokens=0, aborted=True, finished=True, transfer_secret=secret(params))

    def waiting(self) -> bool:
        """Requests matched, registering or waiting for their KV."""
        return bool(self._waiting or self._matched or self._ready)

    def only_waiting_since(self) -> float | None:
        """When the youngest request waiting for its KV registered (time.monotonic()), if that is all this half
        does: some request waits, and none is matched or has a registration still to ship. None otherwise (nothing
        waits, or vLLM is placing a request: its step must not wait). What the pacer bounds its wait by
        (connector.vllm.idle_hold.decode_wait_s)."""
        if not self._waiting or self._matched or self._ready:
            return None
        return max(self._registered_at.get(r, 0.0) for r in self._waiting)

    def pending(self) -> bool:
        return bool(self.aborts)
