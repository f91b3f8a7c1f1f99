"""asyncio-facing wrapper over one NIXL agent with the UCX backend: memory registration, and WRITE posting with
byte backpressure and an optional post-rate cap. No NIXL notifications: completions travel over the side channel
(connector.transport.control), so nothing here polls for them.

Threads: the event loop never calls NIXL on the data path. `post_threads` workers build descriptor lists and run
createXferReq + postXferReq (on DRAM the CMA copy runs inside postXferReq); one poller thread (`poller.py`)
drives PROC transfers to completion. Any NIXL call that touches the UCX worker can
wait for a concurrent copy, so none of them may run on the loop. The agent is created in NIXL_THREAD_SYNC_RW
mode, which makes this sharing safe (see `glue.make_agent`). Control calls (`register`, `add_peer`,
`remove_peer`) are synchronous and may wait briefly for in-progress posts; make them off the hot path.

Unloaded peers' sockets (issue 33). NIXL 1.5.1 closes a removed peer's UCX endpoints in flush mode (its
nixlUcxEp::closeImpl: ucp_ep_close_nbx with no flags; UCP_EP_CLOSE_FLAG_FORCE only for an endpoint that already
failed), and UCX then keeps every endpoint the peer connected back to (all of them, once wireup completed) until
the worker is destroyed or the peer fails (ucp_ep_disconnected in UCX's src/ucp/core/ucp_ep.c: "Endpoints which
have remote connection are destroyed only when the worker is destroyed"). Over TCP that is one socket per UCX worker
(1 + nixl_threads) per unload, held while the peer lives; nothing in NIXL 1.5.1's API closes them sooner. When the
peer goes, UCX closes them, but only on a worker that is progressed: NIXL's progress thread progresses its shared
worker, while each thread-pool worker is progressed only while its thread runs a chunk of a WRITE of 1,024
descriptors or more. So `unload_sweep_s` after the first unload a WRITE to this agent itself, of
1,024 * nixl_threads one-byte descriptors, runs through those threads: their workers close what the departed
peers left (tools/nixl_unload_leak.py measures it; tests/test_nixl_unload_leak.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from typing import Any, Sequence

import numpy as np

from connector.core.errors import TransportError, WriteAbandoned
from connector.transport.loop import wait_out
from connector.transport.nixl.glue import (as_descs, make_agent, memory_region, metadata_agent_name, nixl_errors,
                                         pair_check)
from connector.transport.nixl.poller import Poller, Xfer
from connector.transport.nixl.settings import ByteGate, TransportConfig, TransportStats, WriteTiming

log = logging.getLogger(__name__)


class Transport:
    """One NIXL agent (UCX backend) driven from asyncio. Use as `async with Transport(cfg) as t:`."""

    def __init__(self, config: TransportConfig) -> None:
        self.config = config
        self.stats = TransportStats()
        self._agent: Any = None
        self._errors: tuple[type[BaseException], ...] = ()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._poller: Poller | None = None
        self._gate = ByteGate(config.max_inflight_bytes, self.stats)
        self._throttle = None
        if config.posts_per_second is not None:
            from asyncio_throttle import Throttler  # noqa: PLC0415

            pps = float(config.posts_per_second)
            burst = max(1, int(pps * 0.1))  # windows of ~100 ms: smooth, without per-post sleeps
            self._throttle = Throttler(rate_limit=burst, period=burst / pps, retry_interval=min(0.01, 0.5 / pps))
        self._peers: set[str] = set()
        self._peer_metadata: dict[str, bytes] = {}
        self._failed_peers: set[str] = set()
        """Peers whose NIXL connection ended in an error: the next WRITE to one connects again first (a failed UCX
        endpoint fails every later request at once). Guarded by `_peer_lock`."""
        self._peer_lock = threading.Lock()
        self._regs: list[tuple[Any, Any]] = []  # (nixlRegDList, the object kept alive while registered)
        self._hlock = threading.Lock()
        self._handles: set[Any] = set()
        """Xfer handles not yet released (any thread); `_release` is the only way out of this set."""
        self._closing = False
        self._close_fut: asyncio.Future[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._sweep_buf: np.ndarray | None = None
        """Registered scratch memory of the sweeps' self-WRITEs (first half written to the second)."""

    # ---------------------------------------------------------------- lifetime
    async def open(self) -> "Transport":
        """Create the NIXL agent and start the poller; pair with `aclose()` (or use `async with`)."""
        if self._agent is not None or self._closing:
            raise TransportError(f"transport {self.config.name!r} was already entered; create a new Transport")
        cfg = self.config
        loop = asyncio.get_running_loop()
        self._executor = concurrent.futures.ThreadPoolExecutor(cfg.post_threads, thread_name_prefix=f"nixl-{cfg.name}")
        try:
            self._agent = await loop.run_in_executor(
                self._executor,
                lambda: make_agent(cfg.name, progress_delay_us=cfg.progress_delay_us,
                                   ucx_error_handling_mode=cfg.ucx_error_handling_mode, ucx_config=cfg.ucx_config(),
                                   nixl_threads=cfg.nixl_threads))
            self._errors = nixl_errors()
        except BaseException as exc:
            self._executor.shutdown(wait=False)
            self._closing = True
            raise TransportError(f"could not create NIXL agent {cfg.name!r} with the UCX backend: {exc}") from exc
        self._poller = Poller(self._agent, self._errors, self._release, cfg.name)
        self._poller.start()
        if cfg.unload_sweep_s is not None and cfg.nixl_threads > 0:
            self._sweeper = loop.create_task(self._sweep_loop(cfg.unload_sweep_s), name=f"nixl-sweep-{cfg.name}")
        _note_ucx_exposure()
        return self

    async def __aenter__(self) -> "Transport":
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Refuse new work, wait for posting threads, stop the poller (releasing the handles it holds), remove
        peers, deregister memory, drop the agent. Idempotent; concurrent callers wait for the first."""
        if self._close_fut is not None:
            await asyncio.shield(self._close_fut)
            return
        self._close_fut = asyncio.get_running_loop().create_future()
        self._closing = True
        try:
            if self._sweeper is not None:
                self._sweeper.cancel()
                await asyncio.gather(self._sweeper, return_exceptions=True)
            await asyncio.to_thread(self._teardown)
        finally:
            self._close_fut.set_result(None)

    def _teardown(self) -> None:  # runs off the loop: joining threads and NIXL teardown may take a moment
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._poller is not None:
            self._poller.stop()
            self._poller.join(timeout=30)
        with self._hlock:
            left = list(self._handles)
        for h in left:  # the poller has stopped: whatever is still here gets its last try
            self._release(h)
        with self._hlock:
            stuck, self._handles = self._handles, set()
        if stuck:  # the agent's destructor, which runs next, releases what NIXL still holds
            log.warning("transport %s: %d xfer handle(s) could not be released before close", self.config.name,
                        len(stuck))
        agent = self._agent
        if agent is not None:
            for peer in list(self._peers):
                self._quiet(agent.remove_remote_agent, peer)
            for reg, _obj in self._regs:
                self._quiet(agent.deregister_memory, reg)
        self._peers.clear()
        self._regs.clear()
        # Drop every reference to the agent now, not when this object is collected: the nixl_agent's destructor
        # is what stops its progress thread and UCX worker threads (each costs ~3 % of a core while idle).
        if self._poller is not None and not self._poller.is_alive():
            self._poller.detach()
        self._agent = None

    def _quiet(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - teardown must go on
            log.warning("transport %s: %s%r during close failed: %s", self.config.name, fn.__name__, args, exc)

    def _live_agent(self) -> Any:
        if self._agent is None or self._closing:
            raise TransportError(
                f"transport {self.config.name!r} is closed or was never opened; use `async with Transport(cfg)` "
                f"or `await Transport(cfg).open()`")
        return self._agent

    # ---------------------------------------------------------------- memory and peers
    def register(self, tensor: Any) -> None:
        """Register a contiguous tensor (CPU -> "DRAM", CUDA -> "VRAM" on `tensor.device.index`) or numpy array.
        Send `metadata` to peers after registering."""
        agent = self._live_agent()
        addr, nbytes, mem_type, dev = memory_region(tensor)
        try:
            reg = agent.register_memory([(addr, nbytes, dev, "")], mem_type)
        except self._errors as exc:
            raise TransportError(f"registering {nbytes} B of {mem_type} (device {dev}) at {addr:#x} with "
                                 f"{self.config.name!r} failed: {exc}; is that memory type usable here?") from exc
        self._regs.append((reg, tensor))

    @property
    def metadata(self) -> bytes:
        """This agent's metadata (connection info + registered memory). Send it over our own side channel."""
        return bytes(self._live_agent().get_agent_metadata())

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def agent(self) -> Any:
        """The raw `nixl_agent` (the bench's raw-NIXL baseline, connector.sim.raw_nixl). Do not add or remove peers
        or register memory through it."""
        return self._live_agent()

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._peers)

    def add_peer(self, metadata: bytes, expected_name: str | None = None) -> str:
        """Load a peer's agent metadata (from our side channel) and connect; returns its agent name. Re-adding a
        known peer is a no-op for NIXL; after the peer restarted, `remove_peer` it first. With `expected_name`, the
        metadata must name that agent (checked before NIXL loads anything): a peer cannot pass off another
        agent's metadata, or its own under another agent's name."""
        agent = self._live_agent()
        if expected_name is not None:
            named = metadata_agent_name(metadata)
            if named != expected_name:
                raise TransportError(f"peer metadata names NIXL agent {named!r} but the peer said it is "
                                     f"{expected_name!r}: refusing to load it")
        started = time.monotonic()
        try:
            name = agent.add_remote_agent(bytes(metadata))
        except self._errors as exc:
            raise TransportError(f"transport {self.config.name!r} could not load peer metadata ({len(metadata)} B): "
                                 f"{exc}; send the live peer's current Transport.metadata (not our own)") from exc
        name = name.decode() if isinstance(name, (bytes, bytearray)) else str(name)
        self._peers.add(name)
        self._peer_metadata[name] = bytes(metadata)
        if time.monotonic() - started > 1.0:  # a peer's handshake timeout runs meanwhile: say where the time went
            log.warning("transport %r: loading peer %s took %.1f s", self.config.name, name, time.monotonic() - started)
        return name

    def remove_peer(self, peer: str) -> None:
        """Forget a peer and disconnect from it. Unknown peers are ignored."""
        if peer not in self._peers:
            return
        self._peers.discard(peer)
        self._peer_metadata.pop(peer, None)
        with self._peer_lock:
            self._failed_peers.discard(peer)
        try:
            self._live_agent().remove_remote_agent(peer)
        except self._errors as exc:
            log.warning("transport %s: removing peer %r: %s", self.config.name, peer, exc)
        self.stats.unloads += 1

    # ---------------------------------------------------------------- unloaded peers' sockets (module docstring)
    async def _sweep_loop(self, interval_s: float) -> None:
        """Every `interval_s`, once some peer was unloaded: `sweep_workers` on a post thread. Until close."""
        loop = asyncio.get_running_loop()
        while not self._closing:
            await asyncio.sleep(interval_s)
            if self.stats.unloads == 0 or self._closing or self._executor is None:
                continue
            try:
                await loop.run_in_executor(self._executor, self.sweep_workers)
            except RuntimeError:  # executor shut down: closing
                return
            except Exception as exc:  # noqa: BLE001 - a failed sweep is retried next time; never ends the loop
                log.warning("transport %s: sweeping NIXL's UCX workers failed: %r", self.config.name, exc)

    def sweep_workers(self, timeout_s: float = 10.0) -> bool:
        """Progress the UCX workers of NIXL's thread pool (`nixl_threads`), so that they close the endpoints, and
        sockets, of unloaded peers that have gone: a WRITE from this agent to itself of 1,024 one-byte descriptors
        per thread (NIXL's split_batch_size), which NIXL splits into one chunk per thread. Which thread takes which
        chunk is NIXL's choice, so one sweep may miss a worker that the next reaches. Synchronous; any thread but
        the event loop's. Returns whether the WRITE completed within `timeout_s` (one still running is released
        at close)."""
        agent = self._live_agent()
        n = 1024 * self.config.nixl_threads
        if n == 0:
            return True
        if self._sweep_buf is None:
            buf = np.zeros(2 * n, dtype=np.uint8)
            self.register(buf)
            self._sweep_buf = buf
        base = self._sweep_buf.ctypes.data
        src = np.empty((n, 3), dtype=np.uint64)
        src[:, 0] = base + np.arange(n, dtype=np.uint64)
        src[:, 1] = 1
        src[:, 2] = 0
        dst = src.copy()
        dst[:, 0] += n
        handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(src, "DRAM"), agent.get_xfer_descs(dst, "DRAM"),
                                       self.config.name)
        with self._hlock:
            self._handles.add(handle)
        try:
            state = agent.transfer(handle)
        except BaseException:
            self._release(handle)
            raise
        deadline = time.monotonic() + timeout_s
        while state == "PROC" and time.monotonic() < deadline and not self._closing:
            time.sleep(0.001)
            state = agent.check_xfer_state(handle)
        if state == "PROC":  # never release a running transfer (poller.py): _teardown does, at close
            log.warning("transport %s: a sweep of NIXL's UCX workers did not complete in %g s", self.config.name,
                        timeout_s)
            return False
        self._release(handle)
        if state == "DONE":
            self.stats.sweeps += 1
        return state == "DONE"

    def _check_peer(self, peer: str) -> Any:
        agent = self._live_agent()
        if peer not in self._peers:
            raise TransportError(f"peer {peer!r} is unknown to transport {self.config.name!r} (known: "
                                 f"{sorted(self._peers)}); call add_peer(<peer metadata>) first")
        return agent

    # ---------------------------------------------------------------- data path
    @property
    def inflight_bytes(self) -> int:
        return self._gate.inflight

    @property
    def open_handles(self) -> int:
        """Xfer handles created and not yet released (for tests)."""
        return len(self._handles)

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
        if mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"mem_type must be 'DRAM' or 'VRAM', not {mem_type!r}")
        ld = as_descs(local, local_device)
        rd = as_descs(remote, remote_device)
        nbytes = pair_check(ld, rd)
        agent = self._check_peer(peer)
        if ld.shape[0] == 0:
            return WriteTiming(0.0, 0.0)
        what = (f"WRITE of {ld.shape[0]} descriptor(s) / {nbytes} B ({mem_type}) from {self.config.name!r} "
                f"to peer {peer!r}")
        xfer = Xfer(asyncio.get_running_loop())
        try:
            async with asyncio.timeout(timeout):
                await self._gate.acquire(nbytes)
                try:
                    state, timing = await self._post_and_wait(agent, peer, ld, rd, mem_type, what, xfer)
                finally:
                    self._gate.release(nbytes)
        except TimeoutError:
            self.stats.timeouts += 1
            self._raise_if_abandoned(xfer, f"{what} timed out after {timeout:g} s")
            raise TransportError(f"{what} timed out after {timeout:g} s before it was posted; the peer may be dead "
                                 "or stuck (check it, or raise `timeout` for very large writes)") from None
        except asyncio.CancelledError:
            if self._still_running(xfer):
                await wait_out(xfer.future)
            raise
        if state != "DONE":
            self.stats.errors += 1
            raise TransportError(f"{what} failed with state {state}; the peer may have died or the link to it "
                                 "failed -- the next WRITE to it connects again")
        self.stats.bytes_written += nbytes
        return timing

    def _still_running(self, xfer: Xfer) -> bool:
        """Given up on (timeout, cancel) while NIXL may still move its bytes: counted as abandoned."""
        if xfer.abandoned and not xfer.future.done():
            self.stats.abandoned += 1
            return True
        return False

    def _raise_if_abandoned(self, xfer: Xfer, why: str) -> None:
        """After a timeout: if NIXL may still move this WRITE's bytes, say so, with the future to wait for."""
        if self._still_running(xfer):
            raise WriteAbandoned(
                f"{why}; NIXL still runs it, so its memory on both sides stays in use until it ends (over a cut TCP "
                f"link within tcp_user_timeout_s={self.config.tcp_user_timeout_s})", settled=xfer.future) from None

    async def _post_and_wait(self, agent: Any, peer: str, ld: np.ndarray, rd: np.ndarray, mem_type: str,
                             what: str, xfer: Xfer) -> tuple[str, WriteTiming]:
        if self._throttle is not None:
            await self._throttle.acquire()
        assert self._executor is not None
        try:
            cf = self._executor.submit(self._post, agent, peer, ld, rd, mem_type, xfer)
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
        except self._errors as exc:
            self.stats.errors += 1
            raise TransportError(f"{what} could not be posted: {exc!r}; the peer may have died or its metadata is "
                                 "stale -- re-handshake (remove_peer + add_peer with fresh metadata)") from exc
        return state, WriteTiming(xfer.post_s, time.perf_counter() - xfer.started)

    def _note_outcome(self, peer: str, xfer: Xfer, descriptors: int) -> None:
        """A WRITE ended (on the loop). One that failed leaves its UCX endpoint failed: connect again next time."""
        if xfer.handle is not None:
            self.stats.posts += 1
            self.stats.descriptors += descriptors
        fut = xfer.future
        failed = fut.cancelled() or fut.exception() is not None or fut.result() not in ("DONE", "not posted")
        if failed and peer in self._peers:
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
        if self._closing or xfer.abandoned:
            raise _Closed()
        xfer.started = time.perf_counter()
        self._reconnect_if_failed(agent, peer)
        local = agent.get_xfer_descs(ld, mem_type)
        remote = agent.get_xfer_descs(rd, mem_type)
        handle = agent.initialize_xfer("WRITE", local, remote, peer)
        with self._hlock:
            self._handles.add(handle)
        xfer.handle = handle
        try:
            state = agent.transfer(handle)
        except BaseException:
            self._release(handle)
            raise
        xfer.post_s = time.perf_counter() - xfer.started
        if state == "PROC" and self._poller is not None and not self._closing:
            self._poller.add(xfer)
            return state
        self._release(handle)
        return "ERR (transport closing)" if state == "PROC" else state

    def _reconnect_if_failed(self, agent: Any, peer: str) -> None:
        """(post thread) A peer whose last WRITE failed: drop its failed endpoint and load its metadata again, so
        this WRITE gets a fresh connection. Safe for the memory: UCX ended every request of a failed endpoint."""
        with self._peer_lock:
            if peer not in self._failed_peers:
                return
            self._failed_peers.discard(peer)
            metadata = self._peer_metadata.get(peer)
            try:
                agent.remove_remote_agent(peer)
                self.stats.unloads += 1
                if metadata is not None:
                    agent.add_remote_agent(metadata)
            except self._errors as exc:
                self._failed_peers.add(peer)
                raise TransportError(f"transport {self.config.name!r}: connecting again to peer {peer!r} after its "
                                     f"connection failed: {exc!r}; is it alive and reachable?") from exc
            self.stats.reconnects += 1
        log.info("transport %s: connected again to peer %s after a failed WRITE", self.config.name, peer)

    def _release(self, handle: Any) -> None:
        """The one place an xfer handle is released (any thread), so it is released once: taken out of the live
        set first, so a second call finds nothing to do. Only for transfers NIXL has ended (or at close): see
        poller.py for why a running one is never released. A release NIXL refuses is retried at close."""
        with self._hlock:
            if handle not in self._handles:
                return
            self._handles.discard(handle)
        try:
            handle.release()
        except Exception as exc:  # noqa: BLE001 - stays live, retried at close
            log.warning("transport %s: xfer handle release failed (%s); will retry at close", self.config.name, exc)
            with self._hlock:
                self._handles.add(handle)


def _note_ucx_exposure() -> None:
    """UCX opens its own listener for each agent: on every interface, all of them advertised in the agent's metadata,
    unless UCX_NET_DEVICES names the ones to use. Say so at start-up (README, Security)."""
    if not os.environ.get("UCX_NET_DEVICES"):
        log.warning("UCX_NET_DEVICES is not set: this process's NIXL agent (UCX) listens on every network interface "
                    "of this host and advertises them to its peers; set UCX_NET_DEVICES to the interface(s) the "
                    "KV transfers should use (e.g. mlx5_0:1, or lo on one machine)")


class _Closed(Exception):
    """Internal: the transport closed before a queued post ran."""
