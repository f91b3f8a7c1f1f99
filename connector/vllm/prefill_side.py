"""The prefill half of the scheduler side (a `kv_producer` engine, or a `kv_both` engine's prefill requests): which
requests send, their block ids every step, and their blocks held until every worker reports them sent. No I/O."""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

from vllm.v1.request import RequestStatus

from connector.core.untrusted import is_id, shown
from connector.engine.timeline import PrefillSchedulerPoints, close
from connector.protocol.messages import MAX_TRANSFER_ID
from connector.vllm.config import ConnectorSettings
from connector.vllm.metadata import SendSpec, SparseKVMetadata
from connector.vllm.requests import all_block_ids, check_params, secret_of

log = logging.getLogger(__name__)


class Known(NamedTuple):
    """A request this engine sends, as the scheduler keeps it until every worker sent it."""

    transfer_id: str
    prompt_tokens: int
    secret: str
    """Its transfer_secret ('' for an open transfer): named in prefill's response only."""


class PrefillScheduler:
    def __init__(self, engine_id: str, settings: ConnectorSettings, dp_index: int = 0) -> None:
        self.engine_id = engine_id
        self.settings = settings
        self.dp_index = dp_index
        """This engine's data-parallel rank (vLLM's data_parallel_index): named in prefill's response."""
        self.side_channel_reported: str | None = None
        """host:port of prefill rank (pp0, tp0)'s side channel, as the workers reported it (else from settings)."""
        self.kv_cache_manager: Any = None
        self._known: dict[str, Known] = {}                 # request id -> what it sends
        self._started: set[str] = set()                # shipped to the workers at least once
        self._held: dict[str, float] = {}              # finished (time.monotonic()); blocks kept until finished_sending
        self.aborts: dict[str, str] = {}               # request id -> transfer id, for the next metadata
        self._points: dict[str, PrefillSchedulerPoints] = {}
        """Timelines of known requests until their first chunk ships (connector.engine.timeline)."""
        self.samples: dict[str, list[float]] = {}
        """Stage samples since SchedulerSide.take_stats last drained them."""

    def owns(self, req_id: str) -> bool:
        return req_id in self._known

    def match(self, request: Any, params: dict[str, Any]) -> None:
        """A request asking for `do_remote_decode`: it will send (prefill computes everything itself)."""
        if request.request_id in self._known:
            return
        problem, tid = check_params(params, decode=False), self.transfer_id_of(request)
        if not problem and (len(tid) > MAX_TRANSFER_ID or not is_id(tid)):  # vLLM's request id: a client's text
            problem = (f"its transfer id, vLLM's request id {shown(tid, 100, quote=True)} (kv_transfer_params name "
                       f"no transfer_id), is no id the side channel takes (at most {MAX_TRANSFER_ID} characters, no "
                       f"control, line-separator or bidi character)")
        if problem:
            log.error("request %s: %s; it runs as a plain prefill and nothing is sent", shown(request.request_id),
                      problem)
            return
        self._known[request.request_id] = Known(tid, request.num_prompt_tokens,
                                                secret_of(params, self.settings.require_transfer_secret))
        self._points[request.request_id] = points = PrefillSchedulerPoints()
        points.mark("seen")

    @staticmethod
    def transfer_id_of(request: Any) -> str:
        """The proxy's transfer_id (concurrent flow), or, when a router sent only `do_remote_decode` (the
        sequential flow of vLLM's proxy pattern), vLLM's own request id: unique among this engine's requests, and
        handed to the router in prefill's response."""
        tid = (request.kv_transfer_params or {}).get("transfer_id")
        return tid if isinstance(tid, str) and tid else str(request.request_id)

    def side_channel_addr(self) -> str:
        """host:port decode connects to: what prefill rank (pp0, tp0) reported, else the configured address."""
        if self.side_channel_reported:
            return self.side_channel_reported
        return f"{self.settings.listen_host()}:{self.settings.side_channel_port}"

    def fill(self, meta: SparseKVMetadata, scheduler_output: Any) -> None:
        """This step's sends: every known request scheduled this step, with its tokens computed after it."""
        if not self._known:
            return
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
            known = self._known.get(req_id)
            if known is None or req_id not in computed:
                continue
            tid, prompt = known.transfer_id, known.prompt_tokens
            meta.sends[req_id] = SendSpec(
                transfer_id=tid, num_prompt_tokens=prompt,
                block_ids=all_block_ids(self.kv_cache_manager, req_id, None),
                computed_after_step=min(prompt, computed[req_id] + n_scheduled), new=req_id not in self._started,
                transfer_secret=known.secret)
            self._started.add(req_id)
            self._scheduled(req_id, tid)

    def _scheduled(self, req_id: str, tid: str) -> None:
        """The request's first chunk ships: the end of the scheduler's part of its timeline."""
        points = self._points.pop(req_id, None)
        if points is None:
            return
        close(log, "prefill_scheduler", tid, points, "scheduled", self.settings.log_timeline, self.samples,
              request_id=req_id)

    def sent(self, req_id: str) -> None:
        """Every worker reported the request finished sending: its blocks may go."""
        self._held.pop(req_id, None)
        self._points.pop(req_id, None)
        self._known.pop(req_id, None)
        self._started.discard(req_id)

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """vLLM is done with a request this side knows: (hold its blocks?, kv_transfer_params of the response)."""
        req_id = request.request_id
        known = self._known[req_id]
        if req_id not in self._started:  # never reached the workers: nothing reads its blocks
            self._known.pop(req_id, None)
            self._points.pop(req_id, None)
            return False, None
        self._held[req_id] = time.monotonic()
        if request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            # Aborted or failed prefill: tell decode, stop writing. Blocks are still held until the workers
            # report the transfer finished, so no WRITE in flight reads a reused block.
            self.aborts[req_id] = known.transfer_id
            return True, None
        # What decode needs, in prefill's response: a router that copies kv_transfer_params into the decode
        # leg (vLLM's proxy pattern, llm-d) works unchanged. `prefill_finished` tells decode that this transfer
        # exists already, so a prefill that no longer knows it (restarted, lease gone) refuses at once.
        # `transfer_secret`: the capability decode must prove (the router passes it on; nobody else sees it).
        secret = {"transfer_secret": known.secret} if known.secret else {}
        return True, secret | {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": known.transfer_id,
                      "prefill_addr": self.side_channel_addr(), "prefill_engine_id": self.engine_id,
                      "prefill_dp_rank": self.dp_index, "prefill_finished": True, "lease_s": self.settings.lease_s}

    def holding(self) -> bool:
        """Finished requests whose blocks wait for every worker to report them sent."""
        return bool(self._held)

    def first_expiry(self) -> float | None:
        """time.monotonic() the first held request's lease runs out (if no heartbeat extended it): the workers then
        give it up, and the next step returns its blocks."""
        return min(self._held.values()) + self.settings.lease_s if self._held else None

    def pending(self) -> bool:
        """Blocks held for decode, or aborts to ship: the engine must keep stepping."""
        return bool(self._held) or bool(self.aborts)
