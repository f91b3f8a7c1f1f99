"""The Transport's NIXL polling thread, which drives posted transfers to completion, and its live xfer handles.

Why a thread and not an event-loop task: every NIXL call that touches the UCX worker (getXferStatus,
releaseXferReq, getNotifs) waits on the worker lock while another thread's DRAM post runs its CMA copy inside
postXferReq. Measured here: `get_new_notifs()` blocked 38-48 ms during a 256 MiB WRITE (1.1 s on first touch).
On the loop thread that freezes asyncio; on this thread it costs nothing. The event loop never calls NIXL on
the data path; results come back through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)


class Xfer:
    """One WRITE, shared by the loop (future, abandoned) and the NIXL threads (handle).

    `future` is resolved exactly once, and only when NIXL no longer touches the WRITE's memory: with the terminal
    state ("DONE", "ERR ...") or "not posted", or with the exception posting raised. A writer that gives up
    (timeout, cancel) stops waiting for it, but whoever owns the memory must wait for it before reusing it."""

    __slots__ = ("loop", "future", "abandoned", "handle", "started", "post_s")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[str] = loop.create_future()
        self.abandoned = False  # set by the loop when the writer gave up (timeout/cancel); a plain bool is atomic
        self.handle: Any = None
        self.started = 0.0
        """time.perf_counter() when the post thread began building it."""
        self.post_s = 0.0
        """Seconds createXferReq + postXferReq took."""

    def resolve(self, state: str) -> None:
        self._call(lambda: self.future.set_result(state))

    def fail(self, exc: BaseException) -> None:
        self._call(lambda: self.future.set_exception(exc))

    def _call(self, settle: Callable[[], None]) -> None:
        def _set() -> None:
            if not self.future.done():
                settle()

        try:
            self.loop.call_soon_threadsafe(_set)
        except RuntimeError:  # loop closed: nobody is waiting any more
            pass


class Poller(threading.Thread):
    """Drives posted transfers to completion: polls the state of each pending one (50 us backoff to 1 ms while any
    is pending) and sleeps until the next `add` when none is. Every handle it was given goes to `release` (the
    Transport's `Handles`, the one way a handle is released) once NIXL reports it finished, never before, also
    when its writer gave up: releasing a transfer NIXL still runs does not stop it (UCX's cancel does not apply to RMA).
    Measured across a cut veth with UCX over TCP: a WRITE released while stuck went on reading its source after
    the link came back and landed 194 MB of newer content on the target. A transfer over a dead TCP link ends
    with an error once UCX's TCP_USER_TIMEOUT (TransportConfig.tcp_user_timeout_s) expires."""

    def __init__(self, agent: Any, errors: tuple[type[BaseException], ...], release: Callable[[Any], None],
                 name: str) -> None:
        super().__init__(name=f"nixl-poll-{name}", daemon=True)
        self._agent = agent
        self._errors = errors
        self._release = release
        self._lock = threading.Lock()
        self._pending: list[Xfer] = []
        self._wake = threading.Event()
        self._stopping = False

    def add(self, xfer: Xfer) -> None:
        """Hand over a posted transfer whose state was PROC (called from a post worker thread)."""
        with self._lock:
            self._pending.append(xfer)
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def detach(self) -> None:
        """After the thread ended: drop the agent so the Transport's close can destroy it."""
        self._agent = None

    def run(self) -> None:
        delay = 0.0
        try:
            while not self._stopping:
                if self._poll_xfers():
                    delay = min(0.001, max(0.00005, delay * 2))
                    self._wake.wait(delay)
                else:
                    delay = 0.0
                    self._wake.wait()  # nothing in flight: nothing to poll until add() or stop()
                self._wake.clear()
        finally:
            with self._lock:
                left, self._pending = self._pending, []
            for x in left:  # shutting down: the agent, and with it every connection, is destroyed next
                self._release(x.handle)
                x.resolve("ERR (transport closed)")

    def _poll_xfers(self) -> bool:
        with self._lock:
            pending = list(self._pending)
        if not pending:
            return False
        done = []
        for x in pending:
            try:
                state = self._agent.check_xfer_state(x.handle)
            except self._errors as exc:
                state = f"ERR ({exc!r})"
            if state != "PROC":
                done.append(x)
                self._release(x.handle)
                x.resolve(state)
        if done:
            with self._lock:
                self._pending = [x for x in self._pending if x not in done]
        return bool(self._pending)


class Handles:
    """The xfer handles a Transport created and has not released yet (any thread). `release` is the one way out,
    so each is released once; only for transfers NIXL has ended (or at close): see `Poller` for why a running one
    is never released."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._live: set[Any] = set()

    def __len__(self) -> int:
        return len(self._live)

    def add(self, handle: Any) -> None:
        with self._lock:
            self._live.add(handle)

    def release(self, handle: Any) -> None:
        """Taken out of the live set first, so a second call finds nothing to do. A release NIXL refuses is
        retried at close (`release_all`)."""
        with self._lock:
            if handle not in self._live:
                return
            self._live.discard(handle)
        try:
            handle.release()
        except Exception as exc:  # noqa: BLE001 - stays live, retried at close
            log.warning("transport %s: xfer handle release failed (%s); will retry at close", self.name, exc)
            with self._lock:
                self._live.add(handle)

    def release_all(self) -> int:
        """At close, once the poller stopped: whatever is still here gets its last try. Returns how many could not
        be released; they are forgotten (the agent's destructor releases what NIXL still holds)."""
        with self._lock:
            left = list(self._live)
        for handle in left:
            self.release(handle)
        with self._lock:
            stuck, self._live = self._live, set()
        return len(stuck)
