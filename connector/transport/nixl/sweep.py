"""The Transport's unload sweep: closes the sockets NIXL 1.5.1 keeps for unloaded peers (issue 33).

NIXL 1.5.1 closes a removed peer's UCX endpoints in flush mode (its nixlUcxEp::closeImpl: ucp_ep_close_nbx with no
flags; UCP_EP_CLOSE_FLAG_FORCE only for an endpoint that already failed), and UCX then keeps every endpoint the peer
connected back to (all of them, once wireup completed) until the worker is destroyed or the peer fails
(ucp_ep_disconnected in UCX's src/ucp/core/ucp_ep.c: "Endpoints which have remote connection are destroyed only
when the worker is destroyed"). Over TCP that is one socket per UCX worker (1 + nixl_threads) per unload, held while
the peer lives; nothing in NIXL 1.5.1's API closes them sooner. When the peer goes, UCX closes them, but only on a
worker that is progressed: NIXL's progress thread progresses its shared worker, while each thread-pool worker is
progressed only while its thread runs a chunk of a WRITE of 1,024 descriptors or more. So `unload_sweep_s` after
the first unload a WRITE to this agent itself, of 1,024 * nixl_threads one-byte descriptors, runs through those
threads: their workers close what the departed peers left (tools/nixl_unload_leak.py measures it;
tests/test_nixl_unload_leak.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


class UnloadSweep:
    """A part of one `Transport` (it uses that transport's agent, post threads and handles): every `interval_s`,
    once some peer was unloaded, one sweep on a post thread, until the transport closes."""

    def __init__(self, transport: Any) -> None:
        """`transport`: the connector.transport.nixl.agent.Transport this is a part of (typed loosely: agent.py
        imports this module, and no module imports back)."""
        self.transport = transport
        self._task: asyncio.Task[None] | None = None
        self._buf: np.ndarray | None = None
        """Registered scratch memory of the sweeps' self-WRITEs (first half written to the second)."""

    def start(self, executor: concurrent.futures.ThreadPoolExecutor, interval_s: float) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(executor, interval_s),
                                                            name=f"nixl-sweep-{self.transport.config.name}")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self, executor: concurrent.futures.ThreadPoolExecutor, interval_s: float) -> None:
        t = self.transport
        loop = asyncio.get_running_loop()
        while not t._closing:
            await asyncio.sleep(interval_s)
            if t.stats.unloads == 0 or t._closing:
                continue
            try:
                await loop.run_in_executor(executor, self.sweep)
            except RuntimeError:  # executor shut down: closing
                return
            except Exception as exc:  # noqa: BLE001 - a failed sweep is retried next time; never ends the loop
                log.warning("transport %s: sweeping NIXL's UCX workers failed: %r", t.config.name, exc)

    def sweep(self, timeout_s: float = 10.0) -> bool:
        """Progress the UCX workers of NIXL's thread pool (`nixl_threads`), so that they close the endpoints, and
        sockets, of unloaded peers that have gone: a WRITE from this agent to itself of 1,024 one-byte descriptors
        per thread (NIXL's split_batch_size), which NIXL splits into one chunk per thread. Which thread takes which
        chunk is NIXL's choice, so one sweep may miss a worker that the next reaches. Synchronous; any thread but
        the event loop's. Returns whether the WRITE completed within `timeout_s` (one still running is released
        at close)."""
        t = self.transport
        agent = t._live_agent()
        n = 1024 * t.config.nixl_threads
        if n == 0:
            return True
        if self._buf is None:
            buf = np.zeros(2 * n, dtype=np.uint8)
            t.register(buf)
            self._buf = buf
        base = self._buf.ctypes.data
        src = np.empty((n, 3), dtype=np.uint64)
        src[:, 0] = base + np.arange(n, dtype=np.uint64)
        src[:, 1] = 1
        src[:, 2] = 0
        dst = src.copy()
        dst[:, 0] += n
        handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(src, "DRAM"), agent.get_xfer_descs(dst, "DRAM"),
                                       t.config.name)
        t.handles.add(handle)
        try:
            state = agent.transfer(handle)
        except BaseException:
            t.handles.release(handle)
            raise
        deadline = time.monotonic() + timeout_s
        while state == "PROC" and time.monotonic() < deadline and not t._closing:
            time.sleep(0.001)
            state = agent.check_xfer_state(handle)
        if state == "PROC":  # never release a running transfer (poller.py): the transport's close does
            log.warning("transport %s: a sweep of NIXL's UCX workers did not complete in %g s", t.config.name,
                        timeout_s)
            return False
        t.handles.release(handle)
        if state == "DONE":
            t.stats.sweeps += 1
        return state == "DONE"
