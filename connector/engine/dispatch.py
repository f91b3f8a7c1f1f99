"""Prefill's destination-and-write half: for each decode rank a request has, what goes out when (one batch per
destination at a time, at most `max_writes_per_destination` in flight), its WRITE and its bookkeeping, the Complete
(with kv_checksum's digests first), the notice a stopped destination gets once nothing is in flight, and the
request's release once every destination is done. connector.engine.sender decides who is a destination and when a
layer is ready; this module moves the bytes (through connector.engine.batch_writer) and ends the request."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from connector.core.errors import WriteAbandoned
from connector.core.plan import fold_ranges
from connector.engine.batch_writer import BatchWriter
from connector.engine.config import SenderConfig
from connector.engine.inbox import Inbox
from connector.engine.ownership import Ownership
from connector.engine.peers import PeerTable
from connector.engine.rank import LocalRank
from connector.engine.sender_state import Destination, FinishedInfo, PeerInfo, SendRequest
from connector.engine.stats import SenderStats
from connector.engine.timeline import close
from connector.protocol.messages import Abort, Complete
from connector.transport.connection import ControlConnection
from connector.transport.loop import OwnedTasks, wait_out

log = logging.getLogger("connector.engine.sender")  # (the sender's lines, as before the split)


class Dispatch:
    """One prefill rank's writes to its decode ranks, on the event loop. `pump(req)` whenever something changed
    (a layer ready, a registration served, a WRITE done, an agent loaded); `check_finished` and `stop_dest` for the
    sender's own paths (aborts, closed connections, leases)."""

    def __init__(self, me: LocalRank, config: SenderConfig, writer: BatchWriter, ownership: Ownership,
                 stats: SenderStats, tasks: OwnedTasks, inbox: Inbox, table: PeerTable,
                 on_finished: Callable[[str, bool], None]) -> None:
        self.me, self.config, self.writer, self.ownership, self.stats = me, config, writer, ownership, stats
        self.requests = ownership.requests
        self._tasks, self._inbox, self._table, self._on_finished = tasks, inbox, table, on_finished

    def pump(self, req: SendRequest) -> None:
        for dest in req.dests.values():
            if dest.done:
                continue
            if not dest.peer.agent:  # its first registration served here: load its agent, then pump again
                self._load_agent(dest.peer, dest.conn)
                continue
            # Whatever is ready goes out in ONE write per destination: a per-layer write while layers trickle in
            # during compute, few large writes when the sweep or a late registration releases many layers at
            # once (a NIXL request has a fixed cost, so fewer and larger is faster). At most two writes per
            # destination are in flight; layers that become ready meanwhile batch up behind them.
            if dest.batches_in_flight >= self.config.max_writes_per_destination:
                continue
            # Decode may want fewer tokens than the prompt (vLLM recomputes the last prompt token locally).
            end = dest.register.num_tokens
            batch = [(layer, min(req.ready_tokens.get(layer, 0), end)) for layer in dest.layer_routes
                     if layer not in dest.writing
                     and min(req.ready_tokens.get(layer, 0), end) > max(dest.sent_tokens.get(layer, 0),
                                                                         dest.register.first_token)]
            if batch:
                dest.writing.update(layer for layer, _ in batch)
                dest.batches_in_flight += 1
                self._tasks.spawn(self._write_batch(req, dest, batch))
            self._maybe_complete(req, dest)
        self.note_streaming(req)
        self.check_finished(req)  # e.g. all computed now, and every destination already done or dropped

    def _load_agent(self, peer: PeerInfo, conn: ControlConnection) -> None:
        if peer.loading is None:  # load its agent (once), then pump every request that writes there
            self._tasks.spawn(self._agent_for(peer, conn))

    async def _agent_for(self, peer: PeerInfo, conn: ControlConnection) -> None:
        if await self._table.serve_agent(peer, conn):
            for req in [r for r in self.requests.values() if any(d.peer is peer for d in r.dests.values())]:
                self.pump(req)

    def note_streaming(self, req: SendRequest) -> None:
        """Whether `req`'s layer hooks must wake the loop: it still computes and some decode rank waits for it."""
        if not req.all_computed and any(not d.done for d in req.dests.values()):
            self._inbox.stream(req.transfer_id)
        else:
            self._inbox.unstream(req.transfer_id)

    async def _write_batch(self, req: SendRequest, dest: Destination, batch: list[tuple[int, int]]) -> None:
        req.first_write_at = req.first_write_at or time.time()
        req.points.mark("first_post")
        req.points.mark("last_post", first=False)
        during_compute = not req.all_computed
        layers = [layer for layer, _ in batch]
        generation = req.generation
        by_pool = self.writer.pool_bytes(req, dest, batch)  # before sent_tokens moves on: the spans this WRITE moves
        dest.peer.write_started()  # its agent stays loaded until this is done
        try:
            descs = await self.writer.write(req, dest, batch, lambda ok, why: self._chunk_answered(req, dest, ok, why))
        except Exception as exc:  # noqa: BLE001 - one destination fails, the rest go on
            self._dest_failed(req, dest, f"WRITE of layers {fold_ranges(layers)} failed: {exc}")
            if isinstance(exc, WriteAbandoned):  # NIXL still reads the source blocks (and writes decode's): the
                await wait_out(exc.settled)  # batch stays in flight, the blocks held, Abort unsent, till it ends
            return
        finally:
            dest.peer.write_done()
            dest.writing.difference_update(layers)
            dest.batches_in_flight -= 1
            if dest.done:  # aborted or failed meanwhile: this may have been the last reader of the blocks
                self._flush_notice(dest)
                self.check_finished(req)
        req.points.mark("last_write", first=False)
        if generation == req.generation:  # else a restart made what this WRITE read stale: send it again
            for layer, ready in batch:
                dest.sent_tokens[layer] = ready
        dest.bytes_written += descs.nbytes
        for pool, nbytes in by_pool.items():
            dest.bytes_by_pool[pool] = dest.bytes_by_pool.get(pool, 0) + nbytes
            self.stats.add_pool_bytes(pool, nbytes)
        dest.descriptors += len(descs)
        self.stats.bytes_sent += descs.nbytes
        if during_compute:
            self.stats.bytes_sent_during_compute += descs.nbytes
        self.stats.descriptors += len(descs)
        self.stats.writes += 1
        if self.requests.get(req.transfer_id) is req:
            self.pump(req)

    def _chunk_answered(self, req: SendRequest, dest: Destination, ok: bool, why: str) -> None:
        """Decode's answer to a staged chunk (connector.engine.staging): a refusal fails this destination."""
        if not ok and not dest.done and self.requests.get(req.transfer_id) is req:
            self._dest_failed(req, dest, f"decode did not take a staged chunk: {why}")
        elif not ok:  # stopped meanwhile (an abort: chunks in flight are dropped), or a refusal after Complete
            log.info("transfer %s: decode %s did not take a staged chunk: %s", req.transfer_id, dest.key, why)
        self.check_finished(req, ok=ok)

    def _dest_failed(self, req: SendRequest, dest: Destination, why: str) -> None:
        log.error("transfer %s to decode %s: %s", req.transfer_id, dest.key, why)
        if not dest.done:
            self.stop_dest(req, dest, Abort(req.transfer_id, f"prefill: {why}"))
        if req.expected is not None:
            req.expected.discard(dest.key)
        self.check_finished(req, ok=False)

    def stop_dest(self, req: SendRequest, dest: Destination, notice: Any) -> None:
        """No new WRITE to `dest`; tell it `notice` once the ones in flight have completed."""
        dest.done = True
        dest.notice = notice
        self._flush_notice(dest)

    def _flush_notice(self, dest: Destination) -> None:
        if dest.notice is not None and not dest.batches_in_flight:
            notice, dest.notice = dest.notice, None
            self._tasks.spawn(self.send_quiet(dest.conn, notice))

    def _maybe_complete(self, req: SendRequest, dest: Destination) -> None:
        if dest.done or not req.all_computed or dest.writing:
            return
        end = dest.register.num_tokens
        if end > dest.register.first_token and any(dest.sent_tokens.get(layer, 0) < end for layer in dest.layer_routes):
            return
        dest.done = True
        msg = Complete(req.transfer_id, *self.me.rank, dest.bytes_written, dest.descriptors,
                       dest.staged_chunks, dict(dest.bytes_by_pool))
        self._tasks.spawn(self._complete(req, dest, msg))

    async def _complete(self, req: SendRequest, dest: Destination, msg: Complete) -> None:
        if dest.register.checksum:  # decode verifies (kv_checksum): the digests go first, on the same connection
            try:
                pieces = await asyncio.to_thread(self.writer.checksums, req, dest)
            except Exception as exc:  # noqa: BLE001 - any failure to digest fails this destination, named
                log.error("transfer %s to decode %s: kv_checksum could not digest the blocks sent: %s",
                          req.transfer_id, dest.key, exc)
                await self.send_quiet(dest.conn, Abort(req.transfer_id, f"prefill: kv_checksum failed: {exc}"))
                req.expected.discard(dest.key)
                self.check_finished(req, ok=False)
                return
            for piece in pieces:
                await self.send_quiet(dest.conn, piece)
        await self.send_quiet(dest.conn, msg)
        req.expected.discard(dest.key)
        self.check_finished(req)

    def check_finished(self, req: SendRequest, ok: bool = True) -> None:
        req.failed |= not ok
        # Staged chunks decode has not answered yet keep the request: a refusal must still fail it.
        if req.expected is not None and not req.expected and req.all_computed \
                and all(d.done and not d.batches_in_flight and not self.writer.unanswered(d, req.transfer_id)
                        for d in req.dests.values()):
            self._release(req, ok=not req.failed,
                          why="some decode ranks failed" if req.failed else "all decode ranks completed")

    def _release(self, req: SendRequest, ok: bool, why: str) -> None:
        self._inbox.unstream(req.transfer_id)
        if not self.ownership.release(req, time.monotonic(), FinishedInfo(ok, req.first_write_at)):
            return
        if ok:
            self.stats.sends_ok += 1
        else:
            self.stats.sends_failed += 1
        log.debug("transfer %s released: %s", req.transfer_id, why)
        # (a failed transfer's stages say nothing of the path: its failure is logged on its own)
        close(log, "prefill", req.transfer_id, req.points, "released", self.config.log_timeline,
              self.stats if ok else None, rank=list(self.me.rank), ok=ok, tokens=req.num_tokens,
              loop_cpu_ms=round(req.loop_cpu_ns / 1e6, 3) if req.points.computed else None,
              wake_gap_ms=round(self._inbox.layer_gap_us / 1000, 2))
        if not req.finished.done():
            req.finished.set_result(ok)
        self._on_finished(req.transfer_id, ok)

    async def send_quiet(self, conn: ControlConnection, msg: Any) -> None:
        try:
            await conn.send(msg)
        except Exception as exc:  # noqa: BLE001 - the peer is gone; its close callback handles the rest
            log.warning("could not send %s to %s: %s", type(msg).__name__, conn.address, exc)
