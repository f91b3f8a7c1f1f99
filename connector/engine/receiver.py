"""Receiving side (decode rank): registers its blocks with every prefill rank the plan names, then waits for a
completion from each. Framework-agnostic asyncio on the process's one event loop.

The prefill engines themselves, their connections and the confirmation that a lost source stopped writing are
connector.engine.sources' (the mirror of the sender's connector.engine.peers), the scatter of a staged chunk and its
answer connector.engine.staging's (`StagedReader`); this module keeps the transfers: what each is asked to receive
(`RecvSpec`), what each waits for and the messages about them. Blocks are handed back only once every source writes
nothing more into them (`_Pending.stopped`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Sequence

import msgspec
import numpy as np

from connector.core.block_views import as_decode_sees
from connector.core.checksums import destination_rows, mismatch, transfer_spans
from connector.core.errors import ConnectorError, ControlError, PeerError, TransferFailed, Unreachable
from connector.core.layout import Region
from connector.core.plan import Rank
from connector.core.staging_ranges import allowed_ranges
from connector.core.untrusted import shown, shown_text
from connector.engine.config import ReceiverConfig
from connector.engine.rank import LocalRank
from connector.engine.sources import SourceEngine, SourceTable
from connector.engine.staging import StagedReader
from connector.engine.timeline import ReceivePoints
from connector.protocol.addressing import PrefillAddress
from connector.protocol.auth import engine_public_key, transfer_proof
from connector.protocol.messages import (MAX_TRANSFER_ID, Abort, Checksums, Complete, Error, Register, RegisterAck,
                                         RegisterError, Scatter, Scattered, Stopped)
from connector.transport.base import KVTransport
from connector.transport.connection import ControlConnection
from connector.transport.device_copy import BlockCopier
from connector.transport.loop import OwnedTasks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecvSpec:
    """Decode: blocks to register with the prefill ranks of `prefill_addr` (`StreamReceiver.receive`). The vLLM
    scheduler side sends one per request to every worker (connector.vllm.metadata); `error`, `aborted` and
    `finished` are that worker's to act on."""

    transfer_id: str
    prefill_addr: str
    block_ids: Sequence[list[int]]
    """All blocks of the request, per KV-cache group, from token 0 (prefix hits included)."""
    first_token: int
    """Decode's own prefix-cache hit, in tokens: not transferred."""
    num_tokens: int
    """Tokens to receive up to (the last prompt token is recomputed locally)."""
    prefill_finished: bool = False
    """The params came from prefill's response (sequential flow): prefill already holds the KV, so a prefill that
    does not know the transfer refuses at once instead of waiting for it to start."""
    error: str = ""
    """Set when the request's kv_transfer_params are unusable: the workers fail it at once (failed_recving)."""
    aborted: bool = False
    """Aborted before the registration went out: the workers only tell prefill, so it frees its blocks now
    instead of after its lease."""
    finished: bool = False
    """With `aborted`: vLLM already finished the request (it never had blocks), so nothing is reported back."""
    transfer_secret: str = ""
    """kv_transfer_params' `transfer_secret`: proven to prefill in the registration, never sent."""

    @property
    def prefill(self) -> PrefillAddress:
        """`prefill_addr` parsed (raises ConfigError): the one place it is, for the receive and the aborts alike
        (the scheduler side checked it first: connector.vllm.requests.check_params)."""
        return PrefillAddress.parse(self.prefill_addr)


@dataclass(frozen=True)
class ReceiveResult:
    transfer_id: str
    bytes_written: int
    descriptors: int
    sources: tuple[Rank, ...]
    staged_chunks: int = 0
    bytes_by_pool: dict[str, int] = field(default_factory=dict)
    """`bytes_written` by pool, as the sources reported it."""
    checksummed_blocks: int = 0
    """`kv_checksum`: (route, block) digests decode compared with prefill's, all equal (0: not asked)."""
    points: ReceivePoints = field(default_factory=ReceivePoints)
    """Its timeline on this rank so far (connector.engine.timeline): registered and landed."""


@dataclass
class _Pending:
    transfer_id: str
    engine: SourceEngine
    completes: dict[Rank, asyncio.Future]
    """Per source: its Complete, or an exception."""
    stopped: dict[Rank, asyncio.Future]
    """Per source: resolved once it will write nothing more (Complete, Stopped, its own Abort, a refused
    registration, or a dead connection). Blocks are only handed back to vLLM after all are resolved."""
    block_ids: list[list[int]] = field(default_factory=list)
    allowed: tuple[np.ndarray, np.ndarray] | None = None
    """Byte ranges a staged chunk of this transfer may be scattered to (computed on the first chunk)."""
    digests: dict[Rank, dict[tuple[str, int, tuple[int, int]], bytes]] = field(default_factory=dict)
    """`kv_checksum`: per source, what it says it sent (its Checksums, before its Complete), by route."""
    secret: str = ""
    """The transfer's capability (kv_transfer_params' `transfer_secret`; '' if decode got none): proven, never
    sent, in each Register and Abort (connector.protocol.auth.transfer_proof)."""
    registered: set[Rank] = field(default_factory=set)
    """Sources of `engine` this transfer was registered with, on their connections: only what those send about it
    counts (another prefill that decode talks to cannot complete, fill or fail it)."""

    def proof(self, conn: ControlConnection) -> bytes:
        return transfer_proof(self.secret, conn.nonces, self.transfer_id) if self.secret else b""

    def allowed_ranges(self, regions: list[Region], null_block: int) -> tuple[np.ndarray, np.ndarray]:
        if self.allowed is None:
            self.allowed = allowed_ranges(regions, self.block_ids, null_block)
        return self.allowed

    def source_failed(self, src: Rank, exc: Exception, stopped: bool) -> None:
        if not self.completes[src].done():
            self.completes[src].set_exception(exc)
        if stopped and not self.stopped[src].done():
            self.stopped[src].set_result(None)


class StreamReceiver:
    def __init__(self, me: LocalRank, transport: KVTransport, config: ReceiverConfig) -> None:
        """`transport`: this rank's connector.transport.nixl.Transport, with `me.regions` (and `me.staging`, if
        any) registered; prefill ranks WRITE into them (decode posts nothing itself). With a staging buffer, prefill
        ranks that have one too send scattered blocks as staged chunks (connector.engine.staging)."""
        self.me, self.config = me, config
        self._staged = StagedReader(me, config.staging_slot_bytes)
        """The areas of this rank's staging buffer, one per prefill rank connection, and the staged chunks' scatter."""
        self.hello = me.hello("decode", transport)
        self._pending: dict[str, _Pending] = {}
        self._tasks = OwnedTasks(f"decode rank {me.rank}")
        self.sources = SourceTable(self.hello, me.model, config, self._staged, self._tasks, self)
        """The prefill engines this rank receives from (connector.engine.sources)."""
        self._copier: BlockCopier | None = None
        """`kv_checksum` digests on the KV caches' device (made on first use)."""

    def set_engine_key(self, key: bytes) -> None:
        """The key every decode rank of this engine shares (connector.vllm: minted by the scheduler side): prefill
        then knows the engine as (engine id, key) (connector.protocol.auth.engine_name), so no other peer can claim
        its ranks or keep them out by claiming its id first. Connections opened before keep their identity."""
        if key != self.sources.engine_key:
            public = engine_public_key(key)
            self.hello = self.sources.hello = msgspec.structs.replace(self.hello, engine_key=public)
            self.sources.engine_key = key

    @property
    def busy(self) -> dict[str, int]:
        """Transfers still waiting, and lost prefill ranks still being asked whether they write (0 and 0: idle)."""
        return {"pending": len(self._pending), "confirming": len(self.sources.confirming)}

    async def connect_early(self, prefill: PrefillAddress) -> None:
        """Connect to every rank of the prefill engine at `prefill` now, before any request names it (a decode's
        known prefill, a kv_both pair's other engine): each prefill rank loads this rank's NIXL agent then, which
        on 2 busy cores took 8.7-10 s (issue 32), not inside the first request's time to first token. Raises
        ConnectorError as `receive` does; a later `receive` through `prefill` uses these connections."""
        await self.sources.engine(prefill)

    async def aclose(self) -> None:
        """Close every side-channel connection; every reader task is cancelled and awaited."""
        await self.sources.aclose()
        await self._tasks.aclose()

    # ---- what the sources ask (connector.engine.sources.Transfers) --------------------------------------------
    def wanted_from(self, address: PrefillAddress, port: int) -> list[str]:
        """Transfers still waiting on the prefill rank at `port`: heartbeats extend their leases there."""
        return [p.transfer_id for p in self._pending.values() if p.engine.address == address
                and any(not f.done() and p.engine.port_of(src) == port for src, f in p.completes.items())]

    def stop_waits(self, engine: SourceEngine, src: Rank) -> dict[str, asyncio.Future]:
        """Transfers through `engine` (those connections, not a later one to the same address) still waiting for
        `src` to stop, with the future that says it has."""
        return {p.transfer_id: p.stopped[src] for p in self._pending.values() if p.engine is engine
                and src in p.stopped and not p.stopped[src].done()}

    # ---- messages from the sources -------------------------------------------------------------------------------
    async def read_source(self, engine: SourceEngine, src: Rank, conn: ControlConnection) -> None:
        """Prefill rank `src` -> this rank, in order, one method per message, until the connection closes."""
        async for msg in conn:
            match msg:
                case Scatter():
                    # Handled in line: a Complete that follows it on this connection is dispatched only afterwards.
                    await self._on_scatter(engine, src, conn, msg)
                case Checksums():
                    pend = self._waiting(engine, src, msg)
                    if pend is not None:
                        pend.digests.setdefault(src, {}).update(
                            {(r.pool, r.layer, tuple(r.heads)): r.digests for r in msg.routes})
                case Complete():
                    self._on_complete(engine, src, msg)
                case RegisterError():
                    why = f"refused {shown(msg.transfer_id, quote=True)}: {shown_text(msg.reason)}"
                    self._source_stopped(engine, src, msg, why)
                case Abort():
                    why = f"aborted {shown(msg.transfer_id, quote=True)}: {shown_text(msg.reason)}"
                    self._source_stopped(engine, src, msg, why)
                case Stopped():
                    self._source_stopped(engine, src, msg, f"stopped {msg.transfer_id!r}")
                case RegisterAck():
                    pass  # registered; its Complete (or a refusal) follows
                case Error():
                    log.warning("prefill rank %s reports: %s", src, shown_text(msg.reason))
                case _:
                    log.warning("decode %s: unexpected %s from prefill rank %s", self.me.rank, type(msg).__name__, src)
        self._engine_lost(engine, src, conn)
        await self.sources.drop(engine, f"prefill rank {src} went away")

    def _engine_lost(self, engine: SourceEngine, src: Rank, conn: ControlConnection) -> None:
        """`src`'s connection ended: the whole engine is dropped (connector.engine.sources), so every transfer
        through it fails now on every source that has not completed, also when `src` itself owed this rank nothing
        or already completed (TP2 -> TP2: rank (0, 0) owes decode rank (0, 1) nothing; when its connection is the
        first to go, the readers of the others are cancelled before they could fail anything). Failed, not
        stopped: a source counts as stopped only once it confirmed (see the module docstring)."""
        reason = conn.close_reason or "connection closed"
        for pend in list(self._pending.values()):
            if pend.engine is not engine:
                continue
            lost = f"prefill rank {src} at {conn.address} went away before {pend.transfer_id!r} completed: {reason}"
            for other in pend.completes:
                also = "" if other == src else f" (prefill rank {other}'s connection is dropped with it)"
                pend.source_failed(other, TransferFailed(lost + also), stopped=False)

    def _waiting(self, engine: SourceEngine, src: Rank,
                 msg: Checksums | Complete | RegisterError | Abort | Stopped | Scatter) -> _Pending | None:
        """The transfer `msg` is about, if it still waits on `src` of `engine` and was registered there: a message
        about a transfer registered elsewhere (another prefill this rank talks to, a fake one) changes nothing."""
        pend = self._pending.get(msg.transfer_id)
        if pend is not None and (pend.engine is not engine or src not in pend.registered):
            log.warning("decode %s: ignoring %s for %s from prefill rank %s at %s: the transfer was not registered "
                        "on that connection (it is received from %s)", self.me.rank, type(msg).__name__,
                        shown(msg.transfer_id), src, engine.address, pend.engine.address)
            return None
        if pend is None or src not in pend.completes:
            log.debug("ignoring %s for %s from prefill rank %s (not waiting)", type(msg).__name__, msg.transfer_id,
                      src)
            return None
        return pend

    def _on_complete(self, engine: SourceEngine, src: Rank, msg: Complete) -> None:
        pend = self._waiting(engine, src, msg)
        if pend is not None:
            if not pend.completes[src].done():
                pend.completes[src].set_result(msg)
            if not pend.stopped[src].done():
                pend.stopped[src].set_result(None)

    def _source_stopped(self, engine: SourceEngine, src: Rank, msg: RegisterError | Abort | Stopped,
                        why: str) -> None:
        """`src` writes nothing more for the transfer and will not complete it."""
        pend = self._waiting(engine, src, msg)
        if pend is not None:
            pend.source_failed(src, TransferFailed(f"prefill rank {src} {why}"), stopped=True)

    async def _on_scatter(self, engine: SourceEngine, src: Rank, conn: ControlConnection, msg: Scatter) -> None:
        """Scatter a staged chunk from this source's staging area (connector.engine.staging) and answer Scattered
        either way: its slot is free again then. In line: a Complete that follows on this connection is dispatched
        only after every chunk before it is in place."""
        pend = self._waiting(engine, src, msg)
        if pend is None or pend.completes[src].done():
            # Aborted, failed or finished here: the chunks still in flight from prefill are expected; drop them.
            log.debug("dropping staged chunk %d of %s from prefill rank %s: not being received", msg.seq,
                      msg.transfer_id, src)
            reply = Scattered(msg.transfer_id, msg.seq, False, f"transfer {msg.transfer_id!r} is not being received "
                                                               f"from {src} here (aborted, failed or finished)")
        else:
            reply = await self._staged.answer(msg, src, engine.areas.get(src),
                                              lambda: pend.allowed_ranges(self.hello.regions, self.me.null_block))
            if not reply.ok:  # this source's share of the transfer cannot land: it fails now
                pend.source_failed(src, TransferFailed(f"decode refused staged chunk {msg.seq} of {msg.transfer_id!r} "
                                                       f"from prefill rank {src}: {reply.reason}"), stopped=False)
        try:
            await conn.send(reply)
        except ControlError as exc:
            log.warning("could not answer staged chunk %d of %s: %s", msg.seq, msg.transfer_id, exc)

    # ---- transfers -------------------------------------------------------------------------------------------
    async def receive(self, spec: RecvSpec, timeout: float | None = None,
                      checksum: bool | None = None) -> ReceiveResult:
        """Register `spec.block_ids` (per group, from token 0) with every source and wait until all completed.
        `spec.prefill_finished`: prefill already finished computing (the sequential flow), so a source that does
        not know the transfer refuses at once rather than parking the registration until prefill starts it.
        `spec.transfer_secret`: the transfer's capability, which prefill demands if its request carries one.
        `timeout` (None: `config.transfer_timeout_s`) and `checksum` (verify it end to end; None:
        `config.kv_checksum`) are this call's, not the request's."""
        transfer_id, prefill, first_token, num_tokens = (spec.transfer_id, spec.prefill, spec.first_token,
                                                         spec.num_tokens)
        checksum = self.config.kv_checksum if checksum is None else checksum
        points = ReceivePoints()
        points.mark("registered")
        if transfer_id in self._pending:
            raise TransferFailed(f"transfer {transfer_id!r} is already being received on decode rank {self.me.rank}")
        if len(transfer_id) > MAX_TRANSFER_ID:
            raise TransferFailed(f"transfer id of {len(transfer_id)} characters is longer than the side channel's "
                                 f"{MAX_TRANSFER_ID}: use a shorter id")
        try:
            engine = await self.sources.engine(prefill, for_transfer=transfer_id)
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
                        {src: loop.create_future() for src in layers}, block_ids=[list(g) for g in spec.block_ids],
                        secret=spec.transfer_secret)
        self._pending[transfer_id] = pend
        try:
            async with asyncio.timeout(timeout or self.config.transfer_timeout_s):
                for src, conn in engine.conns.items():
                    offset, nbytes = engine.areas.get(src, (0, 0))
                    pend.registered.add(src)  # before the send: its answer may be read before send() returns
                    await conn.send(Register(transfer_id, *self.me.rank, pend.block_ids, first_token,
                                             num_tokens, layers=sorted(layers[src]),
                                             staging_offset=offset, staging_bytes=nbytes,
                                             after_prefill=spec.prefill_finished, checksum=checksum,
                                             proof=pend.proof(conn)))
                done = await asyncio.gather(*pend.completes.values())
                points.mark("landed")
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
        checked = 0
        if checksum:
            problem, checked = await asyncio.to_thread(self._verify, pend, first_token, num_tokens)
            if problem:
                log.error("transfer %s: %s", transfer_id, problem)
                raise TransferFailed(f"transfer {transfer_id!r}: {problem}")
        by_pool: dict[str, int] = {}
        for c in done:
            for pool, nbytes in c.bytes_by_pool.items():
                by_pool[pool] = by_pool.get(pool, 0) + nbytes
        return ReceiveResult(transfer_id, sum(c.bytes_written for c in done), sum(c.descriptors for c in done),
                             tuple(sorted(pend.completes)), sum(c.staged_chunks for c in done), by_pool, checked,
                             points)

    def _verify(self, pend: _Pending, first_token: int, num_tokens: int) -> tuple[str, int]:
        """`kv_checksum`: digest what every source wrote here (every source completed, so nothing writes into these
        blocks any more) and compare with what it sent: ("" when all agree, else what differs; the (route, block)
        digests compared). Blocking: runs in a worker thread."""
        if self._copier is None:
            self._copier = BlockCopier(f"cuda:{self.me.device_id}" if self.me.mem_type == "VRAM" else "cpu")
        checked = 0
        for src in sorted(pend.completes):
            routes, regions, block_ids, unit, whole = as_decode_sees(
                pend.engine.views.get(src), pend.engine.plan.layer_routes(src, self.me.rank), self.me.by_key,
                pend.block_ids, self.me.null_block, self.me.block_size, self.me.full_block_size)
            spans = transfer_spans(routes, first_token, num_tokens, unit, whole)
            rows = destination_rows(regions, routes, spans, block_ids, self.me.null_block, unit)
            problem = mismatch(src, rows, [self._copier.digests(r.parts) for r in rows], pend.digests.get(src, {}))
            if problem:
                return problem, checked
            checked += sum(int(r.dst_blocks.size) for r in rows)
        return "", checked

    async def abort(self, transfer_id: str, reason: str) -> None:
        """Stop receiving `transfer_id`: its `receive()` raises TransferFailed once every source has confirmed it
        writes nothing more (or is gone), so the caller can then hand the blocks back."""
        pend = self._pending.get(transfer_id)
        if pend is None:
            return
        for src in pend.completes:
            if not pend.completes[src].done():
                pend.completes[src].set_exception(TransferFailed(f"transfer {transfer_id!r} aborted: {reason}"))

    async def abort_unregistered(self, transfer_id: str, prefill: PrefillAddress, reason: str,
                                 secret: str = "") -> None:
        """Decode gave up on a transfer before registering it: tell every prefill rank, so it frees the request's
        blocks now instead of after its lease. Nothing was registered, so nothing can land here. A prefill that
        cannot be reached (or refuses us) holds nothing we could free: one warning, no traceback (vLLM's policy
        "fail" ends every failed decode leg this way, against the same prefill)."""
        try:
            engine = await self.sources.engine(prefill, for_transfer=transfer_id)
        except ConnectorError as exc:
            log.warning("transfer %s: could not tell prefill %s that it was given up (%s): %s", transfer_id,
                        prefill, reason, exc)
            return
        for src, conn in engine.conns.items():
            try:
                await conn.send(Abort(transfer_id, reason, transfer_proof(secret, conn.nonces, transfer_id)
                                      if secret else b""))
            except ControlError as exc:
                log.warning("could not tell prefill rank %s that %s was aborted: %s", src, transfer_id, exc)

    async def _stop_sources(self, pend: _Pending, reason: str) -> None:
        """Abort every source that may still write, then wait (bounded) until each confirms it stopped."""
        for src, conn in pend.engine.conns.items():
            if src not in pend.stopped or pend.stopped[src].done():
                continue
            if conn.is_closed:
                self.sources.confirm_later(pend.engine, src, conn)
                continue
            try:
                await conn.send(Abort(pend.transfer_id, reason, pend.proof(conn)))
            except ControlError as exc:
                log.warning("could not abort %s on prefill rank %s: %s", pend.transfer_id, src, exc)
        waiting = [f for f in pend.stopped.values() if not f.done()]
        if waiting:
            done, not_done = await asyncio.wait(waiting, timeout=self.config.stop_timeout_s)
            if not_done:
                late = sorted(src for src, f in pend.stopped.items() if not f.done())
                log.error("transfer %s: prefill ranks %s did not confirm they stopped writing within %.0f s; "
                          "handing the blocks back anyway", pend.transfer_id, late, self.config.stop_timeout_s)
