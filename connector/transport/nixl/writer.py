"""The Transport's write path: WRITEs admitted under a byte budget (and an optional post-rate cap), posted on the
post threads, driven to completion by the poller (`poller.py`), and a peer whose last WRITE failed connected again
before the next one. The event loop never calls NIXL here (agent.py says why)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Sequence

import numpy as np

from connector.core.errors import TransportError, WriteAbandoned
from connector.transport.loop import wait_out
from connector.transport.nixl.glue import as_descs, pair_check
from connector.transport.nixl.poller import Xfer
from connector.transport.nixl.settings import ByteGate, WriteTiming

log = logging.getLogger(__name__)


class Writer:
    """A part of one `Transport` (it uses that transport's agent, post threads, poller, handles and peers): its
    WRITEs, their byte budget and post rate, and the peers to connect again."""

    def __init__(self, transport: Any) -> None:
        """`transport`: the connector.transport.nixl.agent.Transport this is a part of (typed loosely: agent.py
        imports this module, and no module imports back)."""
        self.transport = transport
        config = transport.config
        self.gate = ByteGate(config.max_inflight_bytes, transport.stats)
        self._throttle = None
        if config.posts_per_second is not None:
            from asyncio_throttle import Throttler  # noqa: PLC0415

            pps = float(config.posts_per_second)
            burst = max(1, int(pps * 0.1))  # windows of ~100 ms: smooth, without per-post sleeps
            self._throttle = Throttler(rate_limit=burst, period=burst / pps, retry_interval=min(0.01, 0.5 / pps))
        self._failed_peers: set[str] = set()
        """Peers whose NIXL connection ended in an error: the next WRITE to one connects again first (a failed UCX
        endpoint fails every later request at once). Guarded by `_peer_lock`."""
        self._peer_lock = threading.Lock()

    def forget(self, peer: str) -> None:
        """`peer` was removed: nothing to connect again to."""
        with self._peer_lock:
            self._failed_peers.discard(peer)

    async def write(self, peer: str, local: Sequence[tuple[int, int]] | np.ndarray,
                    remote: Sequence[tuple[int, int]] | np.ndarray, *, mem_type: str = "DRAM",
                    local_device: int = 0, remote_device: int = 0, timeout: float = 30.0) -> WriteTiming:
        """WRITE local[i] -> remote[i] on `peer` (pairs of (addr, nbytes), or Nx2/Nx3 integer arrays). Returns, with
        its timing, when the transfer is complete.
        ValueError (nothing posted) on mismatched descriptors; TransportError on failure, timeout, unknown peer;
        WriteAbandoned (a TransportError) when it timed out while NIXL still runs it: the memory on both sides stays
        in use until its `settled` future is done. `timeout` covers admission, throttling, posting and completion.
        Cancelled while NIXL runs it, the cancellation is raised once NIXL has ended it (it cannot be stopped, and
        whoever cancelled must not reuse the memory before): within tcp_user_timeout_s on a dead link, or at close."""
        t = self.transport
        if mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"mem_type must be 'DRAM' or 'VRAM', not {mem_type!r}")
        ld = as_descs(local, local_device)
        rd = as_descs(remote, remote_device)
        nbytes = pair_check(ld, rd)
        agent = t._check_peer(peer)
        if ld.shape[0] == 0:
            return WriteTiming(0.0, 0.0)
        what = (f"WRITE of {ld.shape[0]} descriptor(s) / {nbytes} B ({mem_type}) from {t.config.name!r} "
                f"to peer {peer!r}")
        xfer = Xfer(asyncio.get_running_loop())
        try:
            async with asyncio.timeout(timeout):
                await self.gate.acquire(nbytes)
                try:
                    state, timing = await self._post_and_wait(agent, peer, ld, rd, mem_type, what, xfer)
                finally:
                    self.gate.release(nbytes)
        except TimeoutError:
            t.stats.timeouts += 1
            self._raise_if_abandoned(xfer, f"{what} timed out after {timeout:g} s")
            raise TransportError(f"{what} timed out after {timeout:g} s before it was posted; the peer may be dead "
                                 "or stuck (check it, or raise `timeout` for very large writes)") from None
        except asyncio.CancelledError:
            if self._still_running(xfer):
                await wait_out(xfer.future)
            raise
        if state != "DONE":
            t.stats.errors += 1
            raise TransportError(f"{what} failed with state {state}; the peer may have died or the link to it "
                                 "failed -- the next WRITE to it connects again")
        t.stats.bytes_written += nbytes
        return timing

    def _still_running(self, xfer: Xfer) -> bool:
        """Given up on (timeout, cancel) while NIXL may still move its bytes: counted as abandoned."""
        t = self.transport
        if xfer.abandoned and not xfer.future.done():
            t.stats.abandoned += 1
            return True
        return False

    def _raise_if_abandoned(self, xfer: Xfer, why: str) -> None:
        """After a timeout: if NIXL may still move this WRITE's bytes, say so, with the future to wait for."""
        t = self.transport
        if self._still_running(xfer):
            raise WriteAbandoned(
                f"{why}; NIXL still runs it, so its memory on both sides stays in use until it ends (over a cut TCP "
                f"link within tcp_user_timeout_s={t.config.tcp_user_timeout_s})", settled=xfer.future) from None

    async def _post_and_wait(self, agent: Any, peer: str, ld: np.ndarray, rd: np.ndarray, mem_type: str,
                             what: str, xfer: Xfer) -> tuple[str, WriteTiming]:
        t = self.transport
        if self._throttle is not None:
            await self._throttle.acquire()
        assert t._executor is not None
        try:
            cf = t._executor.submit(self._post, agent, peer, ld, rd, mem_type, xfer)
        except RuntimeError:  # executor shut down: aclose() is running
            raise TransportError(f"{what}: transport is closing") from None
        xfer.future.add_done_callback(lambda f: self._note_outcome(peer, xfer, int(ld.shape[0])))
        try:
            # shield: a timeout or cancel must not cancel the future, which also tells when the memory is free
            state = await asyncio.shield(xfer.future)
        except asyncio.CancelledError:
            xfer.abandoned = True  # not started: never posted; posted: the poller drives it to its end
            if cf.cancel() and not xfer.future.done():
                xfer.future.set_result("not posted")
            raise
        except _Closed:
            raise TransportError(f"{what}: transport closed before it was posted") from None
        except t._errors as exc:
            t.stats.errors += 1
            raise TransportError(f"{what} could not be posted: {exc!r}; the peer may have died or its metadata is "
                                 "stale -- re-handshake (remove_peer + add_peer with fresh metadata)") from exc
        return state, WriteTiming(xfer.post_s, time.perf_counter() - xfer.started)

    def _note_outcome(self, peer: str, xfer: Xfer, descriptors: int) -> None:
        """A WRITE ended (on the loop). One that failed leaves its UCX endpoint failed: connect again next time."""
        t = self.transport
        if xfer.handle is not None:
            t.stats.posts += 1
            t.stats.descriptors += descriptors
        fut = xfer.future
        failed = fut.cancelled() or fut.exception() is not None or fut.result() not in ("DONE", "not posted")
        if failed and peer in t._peers:
            with self._peer_lock:
                self._failed_peers.add(peer)

    def _post(self, agent: Any, peer: str, ld: np.ndarray, rd: np.ndarray, mem_type: str, xfer: Xfer) -> None:
        """Post worker thread: build descriptor lists, create and post the request. DONE/ERR: released here and
        resolved. PROC: handed to the poller, which resolves `xfer.future` and releases the handle."""
        try:
            state = self._post_xfer(agent, peer, ld, rd, mem_type, xfer)
        except BaseException as exc:  # noqa: BLE001 - goes to the waiter
            xfer.fail(exc)
            return
        if state != "PROC":
            xfer.resolve(state)

    def _post_xfer(self, agent: Any, peer: str, ld: np.ndarray, rd: np.ndarray, mem_type: str, xfer: Xfer) -> str:
        t = self.transport
        if t._closing or xfer.abandoned:
            raise _Closed()
        xfer.started = time.perf_counter()
        self._reconnect_if_failed(agent, peer)
        local = agent.get_xfer_descs(ld, mem_type)
        remote = agent.get_xfer_descs(rd, mem_type)
        handle = agent.initialize_xfer("WRITE", local, remote, peer)
        t.handles.add(handle)
        xfer.handle = handle
        try:
            state = agent.transfer(handle)
        except BaseException:
            t.handles.release(handle)
            raise
        xfer.post_s = time.perf_counter() - xfer.started
        if state == "PROC" and t._poller is not None and not t._closing:
            t._poller.add(xfer)
            return state
        t.handles.release(handle)
        return "ERR (transport closing)" if state == "PROC" else state

    def _reconnect_if_failed(self, agent: Any, peer: str) -> None:
        """(post thread) A peer whose last WRITE failed: drop its failed endpoint and load its metadata again, so
        this WRITE gets a fresh connection. Safe for the memory: UCX ended every request of a failed endpoint."""
        t = self.transport
        with self._peer_lock:
            if peer not in self._failed_peers:
                return
            self._failed_peers.discard(peer)
            metadata = t._peer_metadata.get(peer)
            try:
                agent.remove_remote_agent(peer)
                t.stats.unloads += 1
                if metadata is not None:
                    agent.add_remote_agent(metadata)
            except t._errors as exc:
                self._failed_peers.add(peer)
                raise TransportError(f"transport {t.config.name!r}: connecting again to peer {peer!r} after its "
                                     f"connection failed: {exc!r}; is it alive and reachable?") from exc
            t.stats.reconnects += 1
        log.info("transport %s: connected again to peer %s after a failed WRITE", t.config.name, peer)


class _Closed(Exception):
    """Internal: the transport closed before a queued post ran."""
