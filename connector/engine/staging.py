"""Both halves of a staged transfer (why: connector.core.staging_ranges), on the engines' event loop; the copies
and the NIXL posts run in worker threads.

Sender (`StagedWriter`): decode gives each prefill rank connection an area of its staging buffer (`Register`'s
staging fields). The writer cuts it into a ring of `ring_slots` slots; a free slot is a credit. Per chunk: take a
credit, take room in this rank's own staging buffer, gather the chunk's rows there block-wise, WRITE it as ONE
descriptor into the slot, and once that WRITE has completed send `Scatter` naming the rows. The next chunk's gather
starts as soon as this chunk's WRITE is handed to NIXL, so the gather of chunk i+1, the WRITE of chunk i and decode's
scatter of chunk i-1 overlap. Decode learns that a chunk landed from that one message, which follows the WRITE
(no round trip). Its answer (`Scattered`) returns the credit; nothing waits for it but the reuse of that slot and
the sender's final account of the request (a refused chunk fails it).

Receiver (`StagedReader`): the areas of this rank's staging buffer, and the scatter of a chunk from its area after
checking that every row lies inside the blocks registered for its transfer (nothing is written otherwise), with
the answer (`Scattered`) that says how it went.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from connector.core.errors import StagedWriteError, StagingError, WriteAbandoned
from connector.core.plan import Rank
from connector.core.untrusted import shown, shown_text
from connector.core.staging_ranges import (Extents, Rows, Segment, check_destinations, chunk_destinations,
                                           chunk_segments)
from connector.engine.rank import LocalRank
from connector.protocol.messages import Register, Scatter, Scattered, StagedRows
from connector.transport.base import KVTransport
from connector.transport.connection import ControlConnection
from connector.transport.device_copy import BlockCopier
from connector.transport.loop import wait_out
from connector.transport.nixl import WriteTiming

log = logging.getLogger(__name__)

ALIGN_BYTES = 4096
"""Slots and extents start at page multiples (any word width works, and DRAM copies stay page-aligned)."""
Answer = Callable[[bool, str], None]
"""Hears decode's answer to one staged chunk: (ok, reason)."""


@dataclass
class _Sent:
    transfer_id: str
    slot: int
    on_answer: Answer
    timer: asyncio.TimerHandle


class _Lane:
    """The staging area decode gave one connection, as a ring of equal slots, and the chunks in it decode has not
    answered yet."""

    def __init__(self, base: int, nbytes: int, ring_slots: int, writes: int = 1) -> None:
        slot = nbytes // max(1, ring_slots) // ALIGN_BYTES * ALIGN_BYTES
        self.slot_bytes = slot if slot else nbytes
        self.area = (base, nbytes)
        self.free = collections.deque(range(0, nbytes - self.slot_bytes + 1, self.slot_bytes))
        self.sent: dict[int, _Sent] = {}
        self.broken = ""
        """Why this lane takes no more chunks (a WRITE into it failed, decode stopped answering); "" = usable."""
        self.writing = asyncio.Semaphore(writes)
        """WRITEs into this area at once (see StagedWriter.__init__)."""
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    async def take(self, timeout_s: float) -> int:
        """A free slot's offset in the area, waiting (FIFO, at most `timeout_s`) for decode to free one. Raises
        StagedWriteError once the lane is broken (see `fail`)."""
        if self.broken:
            raise StagedWriteError(f"staging area unusable: {self.broken}")
        if self.free and not self._waiters:
            return self.free.popleft()
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(timeout_s):
                return await fut
        except TimeoutError:
            raise StagedWriteError(f"no staging slot came free within {timeout_s:g} s: decode answers no chunk "
                                   f"({len(self.sent)} unanswered)") from None
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.give(fut.result())  # granted, then cancelled before we ran: hand it on
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def fail(self, why: str) -> None:
        """No more chunks go into this area: whoever waits for a slot hears why now, not at its timeout."""
        self.broken = self.broken or why
        waiters, self._waiters = self._waiters, collections.deque()
        for fut in waiters:
            if not fut.done():
                fut.set_exception(StagedWriteError(f"staging area unusable: {self.broken}"))

    def give(self, slot: int) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(slot)
                return
        self.free.append(slot)


class StagedWriter:
    def __init__(self, transport: KVTransport, me: LocalRank, timeout_s: float,
                 on_write: Callable[[WriteTiming], None] = lambda timing: None, ring_slots: int = 4) -> None:
        """`me.staging`: a contiguous tensor on the KV device, registered with `transport`. `on_write` hears the
        timing of every chunk's NIXL WRITE."""
        self.transport, self.me, self.timeout_s, self.on_write = transport, me, timeout_s, on_write
        self.ring_slots = ring_slots
        # On DRAM a WRITE is a cross-memory copy into the decode process (UCX cma): two at once into one process
        # move less than one (measured here: 16 MiB chunks, 7.6 GB/s one at a time, 4.1 GB/s two at a time), so
        # chunks to one decode rank are written one after another while the next one is gathered. On a GPU a
        # WRITE is a DMA that takes microseconds: waiting for each to complete before posting the next would leave
        # the link idle, so every slot may be in flight.
        self.writes_per_lane = 1 if me.mem_type == "DRAM" else ring_slots
        self.copier = BlockCopier(me.staging.device)
        self._local = Extents(me.staging_bytes, ALIGN_BYTES)
        self._local_waiters: list[asyncio.Future] = []
        # Half the buffer at most per chunk, so a gather always has room while the previous chunk's WRITE reads.
        self._local_chunk_bytes = max(ALIGN_BYTES, me.staging_bytes // 2 // ALIGN_BYTES * ALIGN_BYTES)
        self._lanes: dict[ControlConnection, _Lane] = {}
        self._seq = itertools.count()

    def usable(self, conn: ControlConnection, reg: Register, peer_staging_addr: int) -> bool:
        """Can chunks go to this decode rank through staging (it gave this connection an area, and no WRITE into
        that area failed)?"""
        if reg.staging_bytes < ALIGN_BYTES or peer_staging_addr == 0 or conn.is_closed:
            return False
        lane = self._lanes.get(conn)
        return lane is None or not lane.broken

    def chunk_bytes(self, conn: ControlConnection, reg: Register) -> int:
        return min(self._lane(conn, reg).slot_bytes, self._local_chunk_bytes)

    def unanswered(self, conn: ControlConnection, transfer_id: str) -> int:
        """Chunks of `transfer_id` sent on `conn` that decode has not answered yet."""
        lane = self._lanes.get(conn)
        return sum(s.transfer_id == transfer_id for s in lane.sent.values()) if lane is not None else 0

    def _lane(self, conn: ControlConnection, reg: Register) -> _Lane:
        lane = self._lanes.get(conn)
        if lane is None or lane.area != (reg.staging_offset, reg.staging_bytes):
            if lane is not None:
                self._close_lane(conn, lane, "decode moved this connection's staging area")
            lane = self._lanes[conn] = _Lane(reg.staging_offset, reg.staging_bytes, self.ring_slots,
                                             self.writes_per_lane)
            if conn.is_closed:  # its one cleanup (connection_closed) may have run already: fail the lane now
                self._close_lane(conn, lane, "the connection closed")
        return lane

    def connection_closed(self, conn: ControlConnection) -> None:
        """`conn` closed (the sender's one cleanup per connection): its lane fails, its chunks count unanswered."""
        lane = self._lanes.get(conn)
        if lane is not None:
            self._close_lane(conn, lane, "the connection closed")

    def _close_lane(self, conn: ControlConnection, lane: _Lane, why: str) -> None:
        if self._lanes.get(conn) is lane:
            del self._lanes[conn]
        lane.fail(why)
        sent, lane.sent = lane.sent, {}
        for s in sent.values():
            s.timer.cancel()
            s.on_answer(False, f"staged chunk of {s.transfer_id} unanswered: {why}")

    # ---- answers -------------------------------------------------------------------------------------------------
    def on_scattered(self, conn: ControlConnection, msg: Scattered) -> None:
        lane = self._lanes.get(conn)
        sent = lane.sent.pop(msg.seq, None) if lane is not None else None
        if sent is None:
            log.warning("Scattered for unknown staged chunk %d of %s (late, or after its connection's area moved)",
                        msg.seq, shown(msg.transfer_id))
            return
        sent.timer.cancel()
        lane.give(sent.slot)
        sent.on_answer(msg.ok, shown_text(msg.reason))  # decode's text: it goes into prefill's log and errors

    def _unanswered(self, lane: _Lane, seq: int) -> None:
        sent = lane.sent.pop(seq, None)
        if sent is not None:  # the slot stays taken: decode may still be reading it
            lane.fail(f"decode did not answer a staged chunk within {self.timeout_s:g} s")
            sent.on_answer(False, lane.broken)

    # ---- writes ----------------------------------------------------------------------------------------------------
    async def write(self, conn: ControlConnection, reg: Register, peer_agent: str, peer_staging_addr: int,
                    peer_device: int, transfer_id: str, segments: Sequence[Segment], on_answer: Answer,
                    stop: Callable[[], bool] = lambda: False) -> int:
        """Move `segments` to decode through its staging area, chunk by chunk, pipelined, until `stop()` says the
        destination is gone. Returns once every chunk's WRITE has completed and its Scatter was sent (decode's
        answers come later, to `on_answer`, one per chunk). Returns the number of chunks sent."""
        lane = self._lane(conn, reg)
        chunks = chunk_segments(segments, self.chunk_bytes(conn, reg))
        remote_area = peer_staging_addr + reg.staging_offset
        sends: list[asyncio.Task] = []
        try:
            for chunk in chunks:
                if stop() or lane.broken:
                    break
                for t in sends:  # a failed WRITE stops the batch now, not after every later gather
                    if t.done() and t.exception() is not None:
                        raise t.exception()
                nbytes = sum(seg.nbytes for seg in chunk)
                slot = await lane.take(self.timeout_s)
                try:
                    local = await self._take_local(nbytes)
                except BaseException:
                    lane.give(slot)
                    raise
                try:
                    await _finish_thread(self.copier.gather, [s.src for s in chunk], self.me.staging_addr + local)
                except BaseException:
                    self._give_local(local)
                    lane.give(slot)
                    raise
                sends.append(asyncio.create_task(self._send(
                    conn, lane, peer_agent, peer_device, remote_area, transfer_id, chunk, nbytes, slot, local,
                    on_answer)))
            await asyncio.gather(*sends)
        except BaseException:
            for t in sends:
                t.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
            raise
        return len(sends)

    async def _send(self, conn: ControlConnection, lane: _Lane, peer_agent: str, peer_device: int, remote_area: int,
                    transfer_id: str, chunk: list[Segment], nbytes: int, slot: int, local: int,
                    on_answer: Answer) -> None:
        try:
            async with lane.writing:
                timing = await self.transport.write(
                    peer_agent, [(self.me.staging_addr + local, nbytes)], [(remote_area + slot, nbytes)],
                    mem_type=self.me.mem_type, local_device=self.me.staging_device, remote_device=peer_device,
                    timeout=self.timeout_s)
        except BaseException as exc:
            # The slot's content is unknown (a timed-out WRITE may still land): it is never reused.
            lane.fail(f"a WRITE into it failed: {exc}")
            if isinstance(exc, WriteAbandoned):  # NIXL still reads that part of this rank's staging buffer: no
                await wait_out(exc.settled)     # gather may refill it until the WRITE has really ended
            raise
        finally:
            self._give_local(local)
        self.on_write(timing)
        seq = next(self._seq)
        timer = asyncio.get_running_loop().call_later(self.timeout_s, self._unanswered, lane, seq)
        lane.sent[seq] = _Sent(transfer_id, slot, on_answer, timer)
        rows = [StagedRows(s.dst.addr, s.dst.stride, s.dst.row_bytes, s.dst.blocks.astype("<i8").tobytes())
                for s in chunk]
        await conn.send(Scatter(transfer_id, seq, nbytes, rows, slot_offset=slot))

    async def _take_local(self, nbytes: int) -> int:
        async with asyncio.timeout(self.timeout_s):
            while (offset := self._local.take(nbytes)) is None:
                fut = asyncio.get_running_loop().create_future()
                self._local_waiters.append(fut)
                await fut
        return offset

    def _give_local(self, offset: int) -> None:
        self._local.give_back(offset)
        waiters, self._local_waiters = self._local_waiters, []
        for fut in waiters:  # each tries again; the buffer is first-fit, so any may fit now
            if not fut.done():
                fut.set_result(None)


class StagedReader:
    def __init__(self, me: LocalRank, area_bytes: int) -> None:
        """`me.staging` (if any): a contiguous tensor on the KV device, registered with this rank's transport. Each
        prefill rank connection gets an area of it of at most `area_bytes` (see `take_area`)."""
        self.me, self.area_bytes = me, area_bytes
        self.copier = BlockCopier(me.staging.device) if me.staging is not None else None
        self.extents = Extents(me.staging_bytes, ALIGN_BYTES)

    def take_area(self, connections: int) -> tuple[int, int] | None:
        """An area for one of `connections` prefill rank connections of one prefill engine: `area_bytes`, or an
        equal share of the buffer when it cannot hold that many. None (that rank then writes directly, which is
        always correct) when the buffer is used up or there is none."""
        share = min(self.area_bytes, self.me.staging_bytes // max(1, connections)) // ALIGN_BYTES * ALIGN_BYTES
        offset = self.extents.take(share) if share >= ALIGN_BYTES else None
        return None if offset is None else (offset, share)

    def give_back(self, area: tuple[int, int]) -> None:
        self.extents.give_back(area[0])

    async def scatter(self, msg: Scatter, area: tuple[int, int], allowed: tuple[np.ndarray, np.ndarray]) -> None:
        """Copy chunk `msg` from its slot in `area` to its rows. Raises StagingError, with nothing written, unless the
        rows add up to the chunk, the chunk lies inside the area and every row lies inside one of the `allowed`
        byte ranges (the blocks registered for the transfer)."""
        rows = [_checked_rows(r) for r in msg.rows]
        total = sum(r.nbytes for r in rows)
        if not rows or total != msg.nbytes or msg.slot_offset < 0 or msg.slot_offset + msg.nbytes > area[1]:
            raise StagingError(f"staged chunk of {msg.nbytes} B at {msg.slot_offset} does not match its rows "
                               f"({total} B) or does not lie inside this connection's {area[1]}-B staging area")
        check_destinations(*chunk_destinations(rows), allowed)
        await _finish_thread(self.copier.scatter, rows, self.me.staging_addr + area[0] + msg.slot_offset)

    async def answer(self, msg: Scatter, src: Rank, area: tuple[int, int] | None,
                     allowed: Callable[[], tuple[np.ndarray, np.ndarray]]) -> Scattered:
        """Scatter chunk `msg` of a transfer being received from prefill rank `src` (its connection's `area`, None if
        it was given none; `allowed()`: the transfer's byte ranges, asked only once the area is known) and say how
        it went. A chunk refused or failed is not written; the answer says why, and the caller fails the transfer
        from `src` (prefill hears it in the answer, and stops)."""
        try:
            if area is None:
                raise StagingError(f"prefill rank {src} was given no staging area")
            await self.scatter(msg, area, allowed())
            return Scattered(msg.transfer_id, msg.seq, True)
        except StagingError as exc:
            log.warning("refusing staged chunk %d of %s from prefill rank %s: %s", msg.seq, msg.transfer_id, src,
                        exc)
            why = str(exc)
        except Exception as exc:  # noqa: BLE001 - the copy failed: tell the sender, keep the connection
            log.error("staged chunk %d of %s from prefill rank %s: scatter failed: %s", msg.seq, msg.transfer_id,
                      src, exc)
            why = f"scatter failed on decode: {exc}"
        return Scattered(msg.transfer_id, msg.seq, False, why)


def _checked_rows(r: StagedRows) -> Rows:
    """A chunk's rows as sent by a peer, refused unless they are sane numbers: positive lengths, distinct
    non-negative blocks, rows that do not overlap each other, addresses far from overflowing."""
    if len(r.blocks) % 8 or not r.blocks or r.row_bytes <= 0 or r.addr < 0 or r.stride < r.row_bytes:
        raise StagingError(f"staged rows ({r.row_bytes} B, stride {r.stride}, {len(r.blocks)} B of block ids) are "
                           f"malformed")
    blocks = np.frombuffer(r.blocks, dtype="<i8").astype(np.int64)
    top = int(blocks.max())
    if int(blocks.min()) < 0 or r.addr + top * r.stride + r.row_bytes >= 1 << 62 or \
            np.unique(blocks).size != blocks.size:
        raise StagingError("staged rows name negative, repeated or impossibly large block ids")
    return Rows(r.addr, r.stride, r.row_bytes, blocks)


async def _finish_thread(fn: Callable[..., None], *args: Any) -> None:
    """Run `fn` in a worker thread and wait for it, even when cancelled meanwhile: a copy cannot be interrupted,
    and whoever cancelled must not hand its memory back while the copy still runs."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    await wait_out(fut)
    fut.result()
