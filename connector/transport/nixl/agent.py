"""asyncio-facing wrapper over one NIXL agent with the UCX backend: memory registration, and WRITE posting with
byte backpressure and an optional post-rate cap. No NIXL notifications: completions travel over the side channel
(connector.transport.control), so nothing here polls for them.

Threads: the event loop never calls NIXL on the data path. `post_threads` workers build descriptor lists and run
createXferReq + postXferReq (on DRAM the CMA copy runs inside postXferReq); one poller thread (`poller.py`)
drives PROC transfers to completion. Any NIXL call that touches the UCX worker can
wait for a concurrent copy, so none of them may run on the loop. The agent is created in NIXL_THREAD_SYNC_RW
mode, which makes this sharing safe (see `glue.make_agent`). Control calls (`register`, `add_peer`,
`remove_peer`) are synchronous and may wait briefly for in-progress posts; make them off the hot path.

Its parts: the write path (`writer.py`), the unload sweep that closes the sockets NIXL keeps for unloaded
peers (`sweep.py`, issue 33), the polling thread and the live xfer handles (`poller.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from typing import Any, Sequence

import numpy as np

from connector.core.errors import TransportError
from connector.transport.nixl.glue import make_agent, memory_region, metadata_agent_name, nixl_errors
from connector.transport.nixl.poller import Handles, Poller
from connector.transport.nixl.settings import TransportConfig, TransportStats, WriteTiming
from connector.transport.nixl.sweep import UnloadSweep
from connector.transport.nixl.writer import Writer

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
        self._peers: set[str] = set()
        self._peer_metadata: dict[str, bytes] = {}
        self._regs: list[tuple[Any, Any]] = []  # (nixlRegDList, the object kept alive while registered)
        self.handles = Handles(config.name)
        """Xfer handles not yet released (any thread): the writes', the sweeps' and the poller's."""
        self._closing = False
        self._close_fut: asyncio.Future[None] | None = None
        self._writer = Writer(self)
        self._sweep = UnloadSweep(self)

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
        self._poller = Poller(self._agent, self._errors, self.handles.release, cfg.name)
        self._poller.start()
        if cfg.unload_sweep_s is not None and cfg.nixl_threads > 0:
            self._sweep.start(self._executor, cfg.unload_sweep_s)
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
            await self._sweep.aclose()
            await asyncio.to_thread(self._teardown)
        finally:
            self._close_fut.set_result(None)

    def _teardown(self) -> None:  # runs off the loop: joining threads and NIXL teardown may take a moment
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._poller is not None:
            self._poller.stop()
            self._poller.join(timeout=30)
        stuck = self.handles.release_all()  # the poller has stopped: whatever is still here gets its last try
        if stuck:  # the agent's destructor, which runs next, releases what NIXL still holds
            log.warning("transport %s: %d xfer handle(s) could not be released before close", self.config.name,
                        stuck)
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
        """The raw `nixl_agent` (the bench's raw-NIXL baseline, sparse_kv_lab.sim.raw_nixl). Do not add or remove peers
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
        self._writer.forget(peer)
        try:
            self._live_agent().remove_remote_agent(peer)
        except self._errors as exc:
            log.warning("transport %s: removing peer %r: %s", self.config.name, peer, exc)
        self.stats.unloads += 1

    def sweep_workers(self, timeout_s: float = 10.0) -> bool:
        """One unload sweep now (connector.transport.nixl.sweep): whether it completed within `timeout_s`.
        Synchronous; any thread but the event loop's."""
        return self._sweep.sweep(timeout_s)

    def _check_peer(self, peer: str) -> Any:
        agent = self._live_agent()
        if peer not in self._peers:
            raise TransportError(f"peer {peer!r} is unknown to transport {self.config.name!r} (known: "
                                 f"{sorted(self._peers)}); call add_peer(<peer metadata>) first")
        return agent

    # ---------------------------------------------------------------- data path
    @property
    def inflight_bytes(self) -> int:
        return self._writer.gate.inflight

    @property
    def open_handles(self) -> int:
        """Xfer handles created and not yet released (for tests)."""
        return len(self.handles)

    async def write(self, peer: str, local: Sequence[tuple[int, int]] | np.ndarray,
                    remote: Sequence[tuple[int, int]] | np.ndarray, *, mem_type: str = "DRAM",
                    local_device: int = 0, remote_device: int = 0, timeout: float = 30.0) -> WriteTiming:
        """WRITE local[i] -> remote[i] on `peer` (pairs of (addr, nbytes), or Nx2/Nx3 integer arrays). Returns, with
        its timing, when the transfer is complete (connector.transport.nixl.writer.Writer.write says what it
        raises and how a timeout or a cancel ends)."""
        return await self._writer.write(peer, local, remote, mem_type=mem_type, local_device=local_device,
                                        remote_device=remote_device, timeout=timeout)


def _note_ucx_exposure() -> None:
    """UCX opens its own listener for each agent: on every interface, all of them advertised in the agent's metadata,
    unless UCX_NET_DEVICES names the ones to use. Say so at start-up (README, Security)."""
    if not os.environ.get("UCX_NET_DEVICES"):
        log.warning("UCX_NET_DEVICES is not set: this process's NIXL agent (UCX) listens on every network interface "
                    "of this host and advertises them to its peers; set UCX_NET_DEVICES to the interface(s) the "
                    "KV transfers should use (e.g. mlx5_0:1, or lo on one machine)")
