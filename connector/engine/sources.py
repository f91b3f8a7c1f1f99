"""The prefill engines a decode rank receives from, one per prefill address: the decode-side mirror of
connector.engine.peers.

A prefill engine is known by the address of its rank (0, 0); the other ranks listen where
`connector.protocol.addressing` says. Rank (0, 0)'s Hello tells the prefill layout, from which the plan, and so the
sources of this rank, follow. At first use the table connects to every rank of that engine (also those the plan
routes nothing from to this rank: each must hear of every transfer to release its blocks at once), checks each, gives
each connection a staging area and a reader; the engine is dropped, all its connections with it, when one of them
ends.

Blocks are handed back only once every source writes nothing more into them. A source says so (Complete, Stopped,
Abort, RegisterError) over its side channel. When that connection is lost instead (a cut link, a silent peer),
NIXL's WRITEs on prefill may still be running and land later: decode cannot stop them (it gets no NIXL error, and
dropping its side of the connection does not stop them either; measured). So the table asks again over a new
connection (`_confirm_stopped`) until the source answers, is gone (connection refused: its process, and with it its
connections, died), or `lost_source_hold_s` has passed, by which time UCX's TCP user timeout on prefill has ended
every WRITE still stuck on the dead link.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Awaitable, Protocol

from connector.core.block_views import PairViews
from connector.core.errors import ControlError, LayoutError
from connector.core.layout import ModelLayout
from connector.core.plan import Rank, TransferPlan
from connector.engine.config import ReceiverConfig
from connector.engine.plans import PlanCache
from connector.engine.staging import StagedReader
from connector.protocol.addressing import PrefillAddress
from connector.protocol.handshake import accept_peer, check_peer_layout, layout_key
from connector.protocol.messages import Abort, Complete, Hello, RegisterError, Stopped
from connector.transport.connection import ControlConnection
from connector.transport.client import connect
from connector.transport.loop import OwnedTasks

log = logging.getLogger(__name__)


@dataclass
class SourceEngine:
    """One prefill engine on live connections: the plan between the two engines, a connection to each of its
    ranks, their readers, and the staging area each rank's connection got here."""

    address: PrefillAddress
    plan: TransferPlan
    conns: dict[Rank, ControlConnection] = field(default_factory=dict)
    readers: list[asyncio.Task] = field(default_factory=list)
    areas: dict[Rank, tuple[int, int]] = field(default_factory=dict)
    """(offset, bytes) of the staging area per prefill rank connection (absent: that rank writes directly)."""
    views: dict[Rank, PairViews | None] = field(default_factory=dict)
    """Per prefill rank, where its block sizes differ from this rank's: the views that cut the larger blocks
    (connector.core.block_views; what kv_checksum digests here)."""

    def port_of(self, src: Rank) -> int:
        return self.address.port_of(src, self.plan.prefill.tp)


class Transfers(Protocol):
    """What the table asks of the receiver about its transfers (connector.engine.receiver.StreamReceiver)."""

    def wanted_from(self, address: PrefillAddress, port: int) -> list[str]:
        """Transfers still waiting on the prefill rank at `port` (heartbeats extend their leases there)."""

    def stop_waits(self, engine: SourceEngine, src: Rank) -> dict[str, asyncio.Future]:
        """Per transfer through `engine` still waiting for `src` to stop: the future to resolve once it has."""

    def read_source(self, engine: SourceEngine, src: Rank, conn: ControlConnection) -> Awaitable[None]:
        """Handle what `src` sends on `conn` until it closes."""


class SourceTable:
    def __init__(self, hello: Hello, model: ModelLayout, config: ReceiverConfig, staged: StagedReader,
                 tasks: OwnedTasks, transfers: Transfers) -> None:
        """`hello`: this decode rank's own. Readers and confirmations run as `tasks`."""
        self.hello, self.model, self.config = hello, model, config
        self.staged, self.tasks, self.transfers = staged, tasks, transfers
        self.plans = PlanCache(model, hello)
        config.side_channel.client_ssl()  # an unreadable CA bundle is a startup error, not a failed transfer
        self.engine_key = b""
        """The private key of `hello.engine_key` (StreamReceiver.set_engine_key), which signs each handshake."""
        self.by_address: dict[PrefillAddress, SourceEngine] = {}
        self._connecting: dict[PrefillAddress, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.confirming: dict[tuple[int, Rank], asyncio.Task] = {}
        """Lost sources being asked whether they still write (`_confirm_stopped`)."""

    async def connect(self, address: PrefillAddress, port: int, timeout: float | None = None,
                      for_transfer: str = "") -> ControlConnection:
        return await connect(address.host, port, self.hello, self.config.side_channel, timeout=timeout,
                             heartbeat_ids=lambda: self.transfers.wanted_from(address, port),
                             for_transfer=for_transfer, check=self._check_layout, engine_key=self.engine_key)

    async def connect_patiently(self, address: PrefillAddress, port: int, for_transfer: str = "") -> ControlConnection:
        """`connect`, once more if the first handshake timed out. Prefill answers a handshake only once it has
        loaded this rank's NIXL agent, and that first load took 25-60 ms between idle processes but 8.7-10 s in
        engines on 2 busy cores (issue 32), past the 10 s handshake timeout. Prefill goes on loading when decode
        gives up, so the second handshake finds the agent loaded (or waits for that load: connector.engine.peers)
        rather than failing the request. A refusal or an error other than the timeout is not retried; the second
        attempt's errors are raised as they come (Unreachable, ControlError)."""
        budget = self.config.side_channel.handshake_timeout_s
        try:
            async with asyncio.timeout(budget):  # fires before connect's own (2 x budget): a timeout, nothing else
                return await self.connect(address, port, 2 * budget, for_transfer=for_transfer)
        except TimeoutError:
            log.warning("handshake with prefill rank at %s:%d timed out after %g s (a prefill loading this rank's "
                        "NIXL agent on a busy machine can take that long; setting handshake_timeout_s): trying once "
                        "more", address.host, port, budget)
        return await self.connect(address, port, budget, for_transfer=for_transfer)

    def _check_layout(self, peer: Hello) -> None:
        """A prefill's claimed layout is checked in the handshake, before decode sends anything about its memory
        (a fake prefill claiming 4096 ranks is refused knowing nothing of it), and before any plan is built."""
        check_peer_layout(peer, self.hello, self.model, self.config.side_channel.max_peer_ranks)

    async def engine(self, address: PrefillAddress, for_transfer: str = "") -> SourceEngine:
        """The prefill engine at `address`, connected to every rank (at first use; raises ConnectorError). The
        connections are opened for `for_transfer`: a prefill rank that refuses one frees that transfer's KV."""
        async with self._connecting[address]:
            engine = self.by_address.get(address)
            if engine is not None:
                return engine
            first = await self.connect_patiently(address, address.port, for_transfer=for_transfer)
            engine = None
            try:
                # (Its claimed layout was checked in the handshake: `_check_layout`.) The plan is built off the loop.
                plan = await self.plans.plan_for(first.peer)
                engine = SourceEngine(address, accept_peer(first.peer, self.hello, self.model, plan).plan)
                # Every prefill rank, also those the plan routes nothing from to this rank: each must hear of
                # every transfer to release its blocks at once (see check_registration in sender_state).
                for src in engine.plan.prefill.ranks():
                    port = engine.port_of(src)
                    conn = first if port == address.port else await self.connect_patiently(
                        address, port, for_transfer=for_transfer)
                    self._check_rank(engine, src, conn, first)
                    engine.conns[src] = conn
                    # none left: this rank writes directly, which is always correct
                    area = self.staged.take_area(len(engine.plan.prefill.ranks()))
                    if area is not None:
                        engine.areas[src] = area
                    reader = self.transfers.read_source(engine, src, conn)
                    engine.readers.append(self.tasks.spawn(reader, name=f"read {src}"))
            except BaseException:
                await first.aclose("handshake checks failed")
                if engine is not None:
                    await self.drop(engine, "handshake checks failed")
                raise
            self.by_address[address] = engine
            return engine

    def _check_rank(self, engine: SourceEngine, src: Rank, conn: ControlConnection, first: ControlConnection) -> None:
        where = f"{engine.address.host}:{engine.port_of(src)}"
        if (conn.peer.pp_rank, conn.peer.tp_rank) != src:
            raise LayoutError(f"{where} is prefill rank ({conn.peer.pp_rank},{conn.peer.tp_rank}), expected {src}: "
                              f"ranks must listen on port + pp * tp_size + tp")
        if layout_key(conn.peer) != layout_key(first.peer):
            raise LayoutError(f"{where} describes another prefill layout than rank (0, 0) does: all ranks of one "
                              f"prefill engine must run the same configuration")
        engine.views[src] = accept_peer(conn.peer, self.hello, self.model, engine.plan).views

    async def drop(self, engine: SourceEngine, reason: str) -> None:
        """Stop talking to that prefill engine: its readers are cancelled and awaited (all but the caller, when a
        reader drops it on its way out), its connections closed, its staging areas given back."""
        if self.by_address.get(engine.address) is engine:
            del self.by_address[engine.address]
        readers, engine.readers = engine.readers, []
        await self.tasks.cancel(readers, timeout_s=10.0)
        for conn in engine.conns.values():
            await conn.aclose(reason)
        for src, conn in engine.conns.items():
            self.confirm_later(engine, src, conn)  # (a source some transfer still waits on keeps its area)
        # The others confirmed they stopped and the readers are done, so no staged chunk lands in these areas now.
        areas, engine.areas = engine.areas, {}
        for area in areas.values():
            self.staged.give_back(area)

    async def aclose(self) -> None:
        for engine in list(self.by_address.values()):
            await self.drop(engine, "receiver closed")

    # ---- sources lost before they confirmed -------------------------------------------------------------------
    def confirm_later(self, engine: SourceEngine, src: Rank, lost: ControlConnection) -> None:
        """Start `_confirm_stopped` for `src` if a transfer waits on it and none runs; it takes the source's area."""
        key = (id(engine), src)  # (the task holds `engine`, so its id stays unique meanwhile)
        if key in self.confirming or not self.transfers.stop_waits(engine, src):
            return
        area = engine.areas.pop(src, None)
        self.confirming[key] = self.tasks.spawn(self._confirm_stopped(engine, src, lost, area), name=f"confirm {src}")

    async def _confirm_stopped(self, engine: SourceEngine, src: Rank, lost: ControlConnection,
                               area: tuple[int, int] | None) -> None:
        """Ask prefill rank `src` over new connections, until `lost_source_hold_s`, to confirm it writes nothing
        more for the transfers still waiting on it (Abort -> Stopped, which it answers once no WRITE of the
        transfer runs). Then they count as stopped, and the source's staging area is free again."""
        hold_s, address, port = self.config.lost_source_hold_s, engine.address, engine.port_of(src)
        deadline = time.monotonic() + hold_s
        why = f"no answer within lost_source_hold_s={hold_s:g} s"
        try:
            while self.transfers.stop_waits(engine, src) and (left := deadline - time.monotonic()) > 0:
                try:
                    conn = await self.connect(address, port, min(left, self.config.side_channel.handshake_timeout_s))
                except ControlError as exc:
                    if isinstance(exc.__cause__, ConnectionRefusedError):
                        why = "its process is gone (connection refused)"
                        break
                    await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))  # unreachable: again
                    continue
                async with conn:
                    if conn.peer.agent_name != lost.peer.agent_name:
                        why = f"it restarted (agent {conn.peer.agent_name}, was {lost.peer.agent_name})"
                        break
                    try:
                        await self._ask_stopped(conn, engine, src, deadline)
                    except (ControlError, TimeoutError):
                        continue  # lost again, or the hold is over
        finally:
            for tid, stopped in self.transfers.stop_waits(engine, src).items():
                log.warning("transfer %s: prefill rank %s counts as stopped: %s", tid, src, why)
                stopped.set_result(None)
            if area is not None:
                self.staged.give_back(area)
            self.confirming.pop((id(engine), src), None)

    async def _ask_stopped(self, conn: ControlConnection, engine: SourceEngine, src: Rank, deadline: float) -> None:
        for tid in self.transfers.stop_waits(engine, src):
            await conn.send(Abort(tid, "decode lost its connection; confirm nothing more is written"))
        while (waiting := self.transfers.stop_waits(engine, src)):
            msg = await conn.recv(max(0.0, deadline - time.monotonic()))
            if isinstance(msg, (Stopped, Complete, Abort, RegisterError)) and msg.transfer_id in waiting:
                log.info("transfer %s: prefill rank %s confirmed it writes nothing more", msg.transfer_id, src)
                waiting[msg.transfer_id].set_result(None)
