"""A Transport's settings, its counters, and the byte gate that applies backpressure to its WRITEs (plain data and
asyncio; nothing here touches NIXL)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass

from connector.core.errors import ConfigError


@dataclass(frozen=True)
class TransportConfig:
    name: str
    """Agent name, unique per process (and among all peers)."""
    progress_delay_us: int = 10_000
    """NIXL progress-thread poll timeout when UCX has nothing to say. Never 0: 0 spins a whole core. The thread
    wakes at once on UCX's event fd (a peer's data, a connection), so this bounds only idle wakeups: at 1 ms they
    took about 3% of prefill's core for as long as it computed (30 ms of a 1 s prefill on the tiny model,
    docs/performance.md); at 10 ms, a tenth of that."""
    max_inflight_bytes: int = 1 << 30
    """Backpressure: bytes admitted but not completed, summed over all writes. A single larger write is admitted
    alone when nothing else is in flight."""
    posts_per_second: float | None = None
    """Optional cap on WRITE posts per second (asyncio_throttle.Throttler); None = off."""
    post_threads: int = 2
    """Worker threads that post transfers (on DRAM the copy itself runs in the posting thread)."""
    nixl_threads: int = 4
    """UCX backend `num_threads`: NIXL spreads a WRITE of 1,024 descriptors or more (its `split_batch_size`) over
    this many threads of its own (0: every descriptor is posted by the calling thread). vLLM's NixlConnector uses 4
    too. Why: a scattered WRITE costs ~3 us of CPU per descriptor (on DRAM one cross-memory copy system call each),
    and on one thread it also contends with NIXL's progress thread for UCX's worker lock; with 4 threads 4096
    tokens of MiniMax-M3 on scattered blocks move at 7.3 GB/s here instead of 4.0 (docs/performance.md)."""
    ucx_error_handling_mode: str = "peer"
    """UCX error handling; "peer" keeps peer-failure detection."""
    tcp_user_timeout_s: float | None = 10.0
    """UCX over TCP: how long sent data may stay unacknowledged before the connection is closed and every WRITE on
    it ends with an error (UCX_TCP_USER_TIMEOUT, the socket's TCP_USER_TIMEOUT). Without it a WRITE across a cut
    link neither finishes nor fails until the kernel's `net.ipv4.tcp_retries2` gives up (15, the default: many
    minutes). A link back within it loses nothing. None: the system's behaviour."""

    unload_sweep_s: float | None = 5.0
    """After a peer was unloaded (remove_peer), how often the UCX workers of NIXL's thread pool are progressed (a
    WRITE of `1024 * nixl_threads` one-byte descriptors to this agent itself, which NIXL spreads over those
    threads). NIXL 1.5.1 closes a peer's UCX endpoints in flush mode, and UCX keeps an endpoint its peer connected
    back to, socket included, until the peer goes; NIXL's thread-pool workers are only progressed while they run a
    transfer, so without this they never notice the peer has gone and keep its sockets (CLOSE_WAIT) for as long
    as this process runs. None: never (tools/nixl_unload_leak.py, docs/security.md)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("TransportConfig.name must be a non-empty agent name")
        if self.progress_delay_us <= 0:
            raise ConfigError("progress_delay_us must be > 0 (0 makes NIXL's progress thread spin a core)")
        if not 0 <= self.nixl_threads <= 64:
            raise ConfigError(f"nixl_threads must be within 0..64, not {self.nixl_threads}")
        if self.max_inflight_bytes <= 0 or self.post_threads <= 0:
            raise ConfigError("max_inflight_bytes and post_threads must be > 0")
        if self.posts_per_second is not None and self.posts_per_second <= 0:
            raise ConfigError("posts_per_second must be > 0 or None")
        if self.ucx_error_handling_mode not in ("peer", "none"):
            raise ConfigError("ucx_error_handling_mode must be 'peer' or 'none'")
        if self.unload_sweep_s is not None and self.unload_sweep_s <= 0:
            raise ConfigError(f"unload_sweep_s must be > 0 or None, not {self.unload_sweep_s}")
        if self.tcp_user_timeout_s is not None and self.tcp_user_timeout_s <= 0:
            raise ConfigError(f"tcp_user_timeout_s must be > 0 or None, not {self.tcp_user_timeout_s}")

    def ucx_config(self) -> dict[str, str]:
        """UCX settings of this agent's backend (see glue.make_agent)."""
        if self.tcp_user_timeout_s is None:
            return {}
        return {"TCP_USER_TIMEOUT": f"{max(1, round(self.tcp_user_timeout_s * 1000))}ms"}


@dataclass(frozen=True)
class WriteTiming:
    """How long one NIXL WRITE took (what vLLM's NIXL connector records as post and transfer durations)."""

    post_s: float
    """Creating and posting it in the post thread (on DRAM the copy runs inside the post)."""
    transfer_s: float
    """From the start of the post until the WRITE completed."""


@dataclass
class TransportStats:
    """Counters. `posts`/`descriptors` count WRITEs handed to NIXL; `bytes_written` counts completed bytes."""

    posts: int = 0
    descriptors: int = 0
    bytes_written: int = 0
    errors: int = 0
    timeouts: int = 0
    abandoned: int = 0
    """WRITEs given up on (timeout, cancel) while NIXL still ran them."""
    reconnects: int = 0
    """Peers whose NIXL connection failed and was made again from their metadata."""
    peak_inflight_bytes: int = 0
    unloads: int = 0
    """Peers unloaded (remove_peer, and each reconnect after a failed WRITE)."""
    sweeps: int = 0
    """Completed progress sweeps of NIXL's thread-pool UCX workers (TransportConfig.unload_sweep_s)."""


class ByteGate:
    """FIFO admission by bytes: admits while `inflight + n <= cap`, or anything when nothing is in flight."""

    def __init__(self, cap: int, stats: TransportStats) -> None:
        self.cap = cap
        self.inflight = 0
        self._stats = stats
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def _fits(self, n: int) -> bool:
        return self.inflight == 0 or self.inflight + n <= self.cap

    def _take(self, n: int) -> None:
        self.inflight += n
        if self.inflight > self._stats.peak_inflight_bytes:
            self._stats.peak_inflight_bytes = self.inflight

    async def acquire(self, n: int) -> None:
        if not self._waiters and self._fits(n):
            self._take(n)
            return
        entry = (n, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        except BaseException:
            if entry[1].done() and not entry[1].cancelled():
                self.release(n)  # granted, then cancelled before we ran: give it back
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, n: int) -> None:
        self.inflight -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, fut = self._waiters.popleft()
            if not fut.done():
                self._take(n)
                fut.set_result(None)
