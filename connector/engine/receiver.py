"""Receiving side (decode rank): registers its blocks with every prefill rank the plan names, then waits for a
completion from each. Framework-agnostic asyncio on the process's one event loop.

A prefill engine is known by the address of its rank (0, 0); the other ranks listen where
`connector.protocol.addressing` says. Rank (0, 0)'s Hello tells the prefill layout, from which the plan, and so the
sources of this rank, follow.

Blocks are handed back only once every source writes nothing more into them. A source says so (Complete, Stopped,
Abort, RegisterError) over its side channel. When that connection is lost instead (a cut link, a silent peer),
NIXL's WRITEs on prefill may still be running and land later: decode cannot stop them (it gets no NIXL error, and
dropping its side of the connection does not stop them either; measured). So it asks again over a new connection
(`_confirm_stopped`) until the source answers, is gone (connection refused: its process, and with it its
connections, died), or `lost_source_hold_s` has passed, by which time UCX's TCP user timeout on prefill has ended
every WRITE still stuck on the dead link.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from connector.core.errors import (ConnectorError, ControlError, LayoutError, PeerError, StagingError, TransferFailed,
                                   Unreachable)
from connector.core.layout import Region
from connector.core.plan import Rank, TransferPlan
from connector.core.staging_ranges import allowed_ranges
from connector.engine.config import ReceiverConfig
from connector.engine.rank import LocalRank
from connector.engine.staging import StagedReader
from connector.engine.plans import PlanCache
from connector.protocol.addressing import PrefillAddress
from connector.protocol.handshake import accept_peer, check_peer_layout, layout_key
from connector.protocol.messages import (MAX_TRANSFER_ID, Abort, Complete, Error, Register, RegisterAck,
                                         RegisterError, Scatter, Scattered, Stopped)
from connector.transport.control import ControlConnection, connect
from connector.transport.loop import OwnedTasks
from connector.transport.tls import client_context

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceiveResult:
    transfer_id: str
    bytes_written: int
    descriptors: int
    sources: tuple[Rank, ...]
    staged_chunks: int = 0
    bytes_by_pool: dict[str, int] = field(default_factory=dict)
    """`bytes_written` by pool, as the sources reported it."""


@dataclass
class _Engine:
    address: PrefillAddress
    plan: TransferPlan
    conns: dict[Rank, ControlConnection] = field(default_factory=dict)
    readers: list[asyncio.Task] = field(default_factory=list)
    areas: dict[Rank, tuple[int, int]] = field(default_factory=dict)
    """(offset, bytes) of the staging area per prefill rank connection (absent: that rank writes directly)."""

    def port_of(self, src: Rank) -> int:
        return self.address.port_of(src, self.plan.prefill.tp)


@dataclass
class _Pending:
    transfer_id: str
    engine: _Engine
    completes: dict[Rank, asyncio.Future]
    """Per source: its Complete, or an exception."""
    stopped: dict[Rank, asyncio.Future]
    """Per source: resolved once it will write nothing more (Complete, Stopped, its own Abort, a refused
    registration, or a dead connection). Blocks are only handed back to vLLM after all are resolved."""
    block_ids: list[list[int]] = field(default_factory=list)
    allowed: tuple[np.ndarray, np.ndarray] | None = None
    """Byte ranges a staged chunk of this transfer may be scattered to (computed on the first chunk)."""

    def allowed_ranges(self, regions: list[Region]) -> tuple[np.ndarray, np.ndarray]:
        if self.allowed is None:
            self.allowed = allowed_ranges(regions, self.block_ids)
        return self.allowed

    def source_failed(self, src: Rank, exc: Exception, stopped: bool) -> None:
        if not self.completes[src].done():
            self.completes[src].set_exception(exc)
        if stopped and not self.stopped[src].done():
            self.stopped[src].set_result(None)


class StreamReceiver:
    def __init__(self, me: LocalRank, transport: Any, config: ReceiverConfig) -> None:
        """`transport`: this rank's connector.transport.nixl.Transport, with `me.regions` (and `me.staging`, if
        any) registered; prefill ranks WRITE into them (decode posts nothing itself). With a staging buffer, prefill
        ranks that have one too send scattered blocks as staged chunks (connector.engine.staging)."""
        self.me, self.config = me, config
        self._staged = StagedReader(me, config.staging_slot_bytes)
        """The areas of this rank's staging buffer, one per prefill rank connection, and the staged chunks' scatter."""
        self.hello = me.hello("decode", transport)
        self._ssl = client_context(config.side_channel.tls_ca_file)
        self._plans = PlanCache(me.model, self.hello)
        self._engines: dict[PrefillAddress, _Engine] = {}
        self._connecting: dict[PrefillAddress, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._pending: dict[str, _Pending] = {}
        self._confirming: dict[tuple[int, Rank], asyncio.Task] = {}
        """Lost sources being asked whether they still write (`_confirm_stopped`)."""
        self._tasks = OwnedTasks(f"decode rank {me.rank}")

    @property
    def busy(self) -> dict[str, int]:
        """Transfers still waiting, and lost prefill ranks still being asked whether they write (0 and 0: idle)."""
        return {"pending": len(self._pending), "confirming": len(self._confirming)}

    async def aclose(self) -> None:
        """Close every side-channel connection; every reader task is cancelled and awaited."""
        for engine in list(self._engines.values()):
            await self._drop_engine(engine, "receiver closed")
        await self._tasks.aclose()

    # ---- connections -----------------------------------------------------------------------------------------
    async def _connect(self, address: PrefillAddress, port: int, timeout: float | None = None) -> ControlConnection:
        side = self.config.side_channel
        return await connect(address.host, port, self.hello, auth_token=side.auth_token, ssl_context=self._ssl,
                             timeout=timeout or side.handshake_timeout_s,
                             heartbeat_interval_s=side.heartbeat_interval_s, dead_after_s=side.dead_after_s,
                             heartbeat_ids=lambda p=port: self._wanted_from(address, p))

    def _wanted_from(self, address: PrefillAddress, port: int) -> list[str]:
        """Transfers still waiting on the prefill rank at `port`: heartbeats extend their leases there."""
        return [p.transfer_id for p in self._pending.values() if p.engine.address == address
                and any(not f.done() and p.engine.port_of(src) == port for src, f in p.completes.items())]

    async def _engine(self, address: PrefillAddress) -> _Engine:
        async with self._connecting[address]:
            engine = self._engines.get(address)
            if engine is not None:
                return engine
            first = await self._connect(address, address.port)
            engine = None
            try:
                # A prefill's claimed layout is checked before the plan is built, off the loop (a fake prefill
                # claiming thousands of ranks must not stall this process).
                check_peer_layout(first.peer, self.hello, self.me.model, self.config.side_channel.max_peer_ranks)
                plan = await self._plans.plan_for(first.peer)
                engine = _Engine(address, accept_peer(first.peer, self.hello, self.me.model, plan).plan)
                # Every prefill rank, also those the plan routes nothing from to this rank: each must hear of
                # every transfer to release its blocks at once (see StreamSender._validate).
                for src in engine.plan.prefill.ranks():
                    port = engine.port_of(src)
                    conn = first if port == address.port else await self._connect(address, port)
                    if (conn.peer.pp_rank, conn.peer.tp_rank) != src:
                        raise LayoutError(f"{address.host}:{port} is prefill rank ({conn.peer.pp_rank},"
                                          f"{conn.peer.tp_rank}), expected {src}: ranks must listen on "
                                          f"port + pp * tp_size + tp")
                    if layout_key(conn.peer) != layout_key(first.peer):
                        raise LayoutError(f"{address.host}:{port} describes another prefill layout than rank (0, 0) "
                                          f"does: all ranks of one prefill engine must run the same configuration")
                    accept_peer(conn.peer, self.hello, self.me.model, engine.plan)
                    engine.conns[src] = conn
                    # none left: this rank writes directly, which is always correct
                    area = self._staged.take_area(len(engine.plan.prefill.ranks()))
                    if area is not None:
                        engine.areas[src] = area
                    engine.readers.append(self._tasks.spawn(self._read(engine, src, conn), name=f"read {src}"))
            except BaseException:
                await first.aclose("handshake checks failed")
                if engine is not None:
                    await self._drop_engine(engine, "handshake checks failed")
                raise
            self._engines[address] = engine
            return engine

    async def _drop_engine(self, engine: _Engine, reason: str) -> None:
        """Stop talking to that prefill engine: its readers are cancelled and awaited (all but the caller, when a
        reader drops it on its way out), its connections closed, its staging areas given back."""
        if self._engines.get(engine.address) is engine:
            del self._engines[engine.address]
        readers, engine.readers = engine.readers, []
        await self._tasks.cancel(readers, timeout_s=10.0)
        for conn in engine.conns.values():
            await conn.aclose(reason)
        for src, conn in engine.conns.items():
            self._confirm_later(engine, src, conn)  # (a source some transfer still waits on keeps its area)
        # The others confirmed they stopped and the readers are done, so no staged chunk lands in these areas now.
        areas, engine.areas = engine.areas, {}
        for area in areas.values():
            self._staged.give_back(area)

    async def _read(self, engine: _Engine, src: Rank, conn: ControlConnection) -> None:
        """Prefill rank `src` -> this rank, in order, one method per message, until the connection closes."""
        async for msg in conn:
            match msg:
                case Scatter():
                    # Handled in line: a Complete that follows it on this connection is dispatched only afterwards.
                    await self._on_scatter(engine, src, conn, msg)
                case Complete():
                    self._on_complete(src, msg)
                case RegisterError():
                    self._source_stopped(src, msg, f"refused {msg.transfer_id!r}: {msg.reason}")
                case Abort():
                    self._source_stopped(src, msg, f"aborted {msg.transfer_id!r}: {msg.reason}")
                case Stopped():
                    self._source_stopped(src, msg, f"stopped {msg.transfer_id!r}")
                case RegisterAck():
                    pass  # registered; its Complete (or a refusal) follows
                case Error():
                    log.warning("prefill rank %s reports: %s", src, msg.reason)
                case _:
                    log.warning("decode %s: unexpected %s from prefill rank %s", self.me.rank, type(msg).__name__, src)
        reason = conn.close_reason or "connection closed"
        for pend in list(self._pending.values()):
            if pend.engine is engine and src in pend.completes:
                # Failed now; stopped only once confirmed (see the module docstring).
                pend.source_failed(src, TransferFailed(f"prefill rank {src} at {conn.address} went away before "
                                                       f"completing {pend.transfer_id!r}: {reason}"), stopped=False)
        await self._drop_engine(engine, f"prefill rank {src} went away")

    def _waiting(self, src: Rank, msg: Complete | RegisterError | Abort | Stopped) -> _Pending | None:
        """The transfer `msg` is about, if it still waits on `src`."""
        pend = self._pending.get(msg.transfer_id)
        if pend is None or src not in pend.completes:
            log.debug("ignoring %s for %s from prefill rank %s (not waiting)", type(msg).__name__, msg.transfer_id,
                      src)
            return None
        return pend

    def _on_complete(self, src: Rank, msg: Complete) -> None:
        pend = self._waiting(src, msg)
        if pend is not None:
            if not pend.completes[src].done():
                pend.completes[src].set_result(msg)
            if not pend.stopped[src].done():
                pend.stopped[src].set_result(None)

    def _source_stopped(self, src: Rank, msg: RegisterError | Abort | Stopped, why: str) -> None:
        """`src` writes nothing more for the transfer and will not complete it."""
        pend = self._waiting(src, msg)
        if pend is not None:
            pend.source_failed(src, TransferFailed(f"prefill rank {src} {why}"), stopped=True)

    async def _on_scatter(self, engine: _Engine, src: Rank, conn: ControlConnection, msg: Scatter) -> None:
        """Scatter a staged chunk from this source's staging area (connector.engine.staging) and answer Scattered
        either way: its slot is free again then. In line: a Complete that follows on this connection is dispatched
        only after every chunk before it is in place."""
        pend = self._pending.get(msg.transfer_id)
        if pend is None or src not in pend.completes or pend.completes[src].done():
            # Aborted, failed or finished here: the chunks still in flight from prefill are expected; drop them.
            log.debug("dropping staged chunk %d of %s from prefill rank %s: not being received", msg.seq,
                      msg.transfer_id, src)
            reply = Scattered(msg.transfer_id, msg.seq, False, f"transfer {msg.transfer_id!r} is not being received "
                                                               f"from {src} here (aborted, failed or finished)")
        else:
            reply = await self._scatter(engine, src, pend, msg)
        try:
            await conn.send(reply)
        except ControlError as exc:
            log.warning("could not answer staged chunk %d of %s: %s", msg.seq, msg.transfer_id, exc)

    async def _scatter(self, engine: _Engine, src: Rank, pend: _Pending, msg: Scatter) -> Scattered:
        """Scatter one chunk of a transfer being received; a chunk refused or failed fails the transfer from this
        source at once (prefill hears why in the answer, and stops)."""
        try:
            area = engine.areas.get(src)
            if area is None:
                raise StagingError(f"prefill rank {src} was given no staging area")
            await self._staged.scatter(msg, area, pend.allowed_ranges(self.hello.regions))
            return Scattered(msg.transfer_id, msg.seq, True)
        except StagingError as exc:
            log.warning("refusing staged chunk %d of %s from prefill rank %s: %s", msg.seq, msg.transfer_id, src,
                        exc)
            why = str(exc)
        except Exception as exc:  # noqa: BLE001 - the copy failed: tell the sender, keep the connection
            log.error("staged chunk %d of %s from prefill rank %s: scatter failed: %s", msg.seq, msg.transfer_id,
                      src, exc)
            why = f"scatter failed on decode: {exc}"
        pend.source_failed(src, TransferFailed(f"decode refused staged chunk {msg.seq} of {msg.transfer_id!r} from "
                                               f"prefill rank {src}: {why}"), stopped=False)
        return Scattered(msg.transfer_id, msg.seq, False, why)

    # ---- transfers -------------------------------------------------------------------------------------------
    async def receive(self, transfer_id: str, prefill: PrefillAddress, block_ids: list[list[int]],
                      first_token: int, num_tokens: int, timeout: float | None = None,
                      after_prefill: bool = False) -> ReceiveResult:
        """Register `block_ids` (per group, from token 0) with every source and wait until all completed.
        `after_prefill`: prefill already finished computing (the sequential flow), so a source that does not know
        the transfer refuses at once rather than parking the registration until prefill starts it."""
        if transfer_id in self._pending:
            raise TransferFailed(f"transfer {transfer_id!r} is already being received on decode rank {self.me.rank}")
        if len(transfer_id) > MAX_TRANSFER_ID:
            raise TransferFailed(f"transfer id of {len(transfer_id)} characters is longer than the side channel's "
                                 f"{MAX_TRANSFER_ID}: use a shorter id")
        try:
            engine = await self._engine(prefill)
        except Unreachable as exc:  # nothing answered at that address
            raise TransferFailed(f"cannot reach prefill {prefill} for {transfer_id!r}: {exc}") from exc
        except ConnectorError as exc:  # it answered: a refused handshake, or a layout that does not fit ours
            raise TransferFailed(f"prefill {prefill} answered, but decode cannot use it for {transfer_id!r}: "
                                 f"{exc}") from exc
        layers: dict[Rank, set[int]] = {src: set() for src in engine.conns}
        for r in engine.plan.routes_to(self.me.rank):
            layers[r.src.rank].add(r.layer)
        loop = asyncio.get_running_loop()
        pend = _Pending(transfer_id, engine, {src: loop.create_future() for src in layers},
                        {src: loop.create_future() for src in layers}, block_ids=[list(g) for g in block_ids])
        self._pending[transfer_id] = pend
        try:
            async with asyncio.timeout(timeout or self.config.transfer_timeout_s):
                for src, conn in engine.conns.items():
                    offset, nbytes = engine.areas.get(src, (0, 0))
                    await conn.send(Register(transfer_id, *self.me.rank, block_ids, first_token,
                                             num_tokens, layers=sorted(layers[src]),
                                             staging_offset=offset, staging_bytes=nbytes,
                                             after_prefill=after_prefill))
                done = await asyncio.gather(*pend.completes.values())
        except TimeoutError:
            missing = sorted(src for src, f in pend.completes.items() if not f.done())
            await asyncio.shield(self._stop_sources(pend, "decode timed out"))
            raise TransferFailed(f"transfer {transfer_id!r}: no completion from prefill ranks {missing} of {prefill} "
                                 f"within {timeout or self.config.transfer_timeout_s:.1f} s") from None
        except PeerError as exc:
            await asyncio.shield(self._stop_sources(pend, f"decode gave up: {exc}"))
            raise TransferFailed(str(exc)) from exc
        except asyncio.CancelledError:
            await asyncio.shield(self._stop_sources(pend, "decode aborted the request"))
            raise
        finally:
            self._pending.pop(transfer_id, None)
            for f in pend.completes.values():
                if f.done() and not f.cancelled():
                    f.exception()  # retrieved: no "exception never retrieved" noise
        by_pool: dict[str, int] = {}
        for c in done:
            for pool, nbytes in c.bytes_by_pool.items():
                by_pool[pool] = by_pool.get(pool, 0) + nbytes
        return ReceiveResult(transfer_id, sum(c.bytes_written for c in done), sum(c.descriptors for c in done),
                             tuple(sorted(pend.completes)), sum(c.staged_chunks for c in done), by_pool)

    async def abort(self, transfer_id: str, reason: str) -> None:
        """Stop receiving `transfer_id`: its `receive()` raises TransferFailed once every source has confirmed it
        writes nothing more (or is gone), so the caller can then hand the blocks back."""
        pend = self._pending.get(transfer_id)
        if pend is None:
            return
        for src in pend.completes:
            if not pend.completes[src].done():
                pend.completes[src].set_exception(TransferFailed(f"transfer {transfer_id!r} aborted: {reason}"))

    async def abort_unregistered(self, transfer_id: str, prefill: PrefillAddress, reason: str) -> None:
        """Decode gave up on a transfer before registering it: tell every prefill rank, so it frees the request's
        blocks now instead of after its lease. Nothing was registered, so nothing can land here."""
        engine = await self._engine(prefill)
        for src, conn in engine.conns.items():
            try:
                await conn.send(Abort(transfer_id, reason))
            except ControlError as exc:
                log.warning("could not tell prefill rank %s that %s was aborted: %s", src, transfer_id, exc)

    async def _stop_sources(self, pend: _Pending, reason: str) -> None:
        """Abort every source that may still write, then wait (bounded) until each confirms it stopped."""
        for src, conn in pend.engine.conns.items():
            if src not in pend.stopped or pend.stopped[src].done():
                continue
            if conn.is_closed:
                self._confirm_later(pend.engine, src, conn)
                continue
            try:
                await conn.send(Abort(pend.transfer_id, reason))
            except ControlError as exc:
                log.warning("could not abort %s on prefill rank %s: %s", pend.transfer_id, src, exc)
        waiting = [f for f in pend.stopped.values() if not f.done()]
        if waiting:
            done, not_done = await asyncio.wait(waiting, timeout=self.config.stop_timeout_s)
            if not_done:
                late = sorted(src for src, f in pend.stopped.items() if not f.done())
                log.error("transfer %s: prefill ranks %s did not confirm they stopped writing within %.0f s; "
                          "handing the blocks back anyway", pend.transfer_id, late, self.config.stop_timeout_s)

    # ---- sources lost before they confirmed -------------------------------------------------------------------
    def _waiting_on(self, engine: _Engine, src: Rank) -> list[_Pending]:
        """Transfers through `engine` (those connections, not a later one to the same address) still waiting for
        `src` to stop."""
        return [p for p in self._pending.values() if p.engine is engine and src in p.stopped
                and not p.stopped[src].done()]

    def _confirm_later(self, engine: _Engine, src: Rank, lost: ControlConnection) -> None:
        """Start `_confirm_stopped` for `src` if a transfer waits on it and none runs; it takes the source's area."""
        key = (id(engine), src)  # (the task holds `engine`, so its id stays unique meanwhile)
        if key in self._confirming or not self._waiting_on(engine, src):
            return
        area = engine.areas.pop(src, None)
        self._confirming[key] = self._tasks.spawn(self._confirm_stopped(engine, src, lost, area),
                                                  name=f"confirm {src}")

    async def _confirm_stopped(self, engine: _Engine, src: Rank, lost: ControlConnection,
                               area: tuple[int, int] | None) -> None:
        """Ask prefill rank `src` over new connections, until `lost_source_hold_s`, to confirm it writes nothing
        more for the transfers still waiting on it (Abort -> Stopped, which it answers once no WRITE of the
        transfer runs). Then they count as stopped, and the source's staging area is free again."""
        hold_s, address, port = self.config.lost_source_hold_s, engine.address, engine.port_of(src)
        deadline = time.monotonic() + hold_s
        why = f"no answer within lost_source_hold_s={hold_s:g} s"
        try:
            while self._waiting_on(engine, src) and (left := deadline - time.monotonic()) > 0:
                try:
                    conn = await self._connect(address, port, min(left, self.config.side_channel.handshake_timeout_s))
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
            for pend in self._waiting_on(engine, src):
                log.warning("transfer %s: prefill rank %s counts as stopped: %s", pend.transfer_id, src, why)
                pend.stopped[src].set_result(None)
            if area is not None:
                self._staged.give_back(area)
            self._confirming.pop((id(engine), src), None)

    async def _ask_stopped(self, conn: ControlConnection, engine: _Engine, src: Rank, deadline: float) -> None:
        for pend in self._waiting_on(engine, src):
            await conn.send(Abort(pend.transfer_id, "decode lost its connection; confirm nothing more is written"))
        while (waiting := {p.transfer_id: p for p in self._waiting_on(engine, src)}):
            msg = await conn.recv(max(0.0, deadline - time.monotonic()))
            if isinstance(msg, (Stopped, Complete, Abort, RegisterError)) and msg.transfer_id in waiting:
                log.info("transfer %s: prefill rank %s confirmed it writes nothing more", msg.transfer_id, src)
                waiting[msg.transfer_id].stopped[src].set_result(None)
