"""How one batch (the layers ready for one decode rank) leaves a prefill rank: its descriptors, then either ONE
direct NIXL WRITE of them or staged chunks (connector.engine.staging), whichever posts fewer descriptors for the
cost. The sender (connector.engine.sender) keeps the bookkeeping; this holds the choice and the posting.

The choice, per batch: stage when both sides have a staging buffer, the batch has at least `stage_min_descriptors`
descriptors and they average fewer than `stage_below_bytes` (blocks scattered: many small descriptors); else write
directly (blocks already in long runs, or a batch too small to pay for a gather and a scatter).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from connector.core.checksums import source_rows, transfer_spans
from connector.core.descriptors import (Descriptors, LayerDescriptors, batch_descriptors, batch_pool_bytes,
                                        span_descriptors)
from connector.core.layout import Region, blocks_for
from connector.core.staging_ranges import batch_segments
from connector.engine.config import SenderConfig
from connector.engine.rank import LocalRank
from connector.engine.sender_state import Destination, SendRequest
from connector.engine.staging import StagedWriter
from connector.engine.stats import SenderStats
from connector.protocol.messages import Checksums, RouteDigests
from connector.transport.base import KVTransport
from connector.transport.device_copy import BlockCopier

CHECKSUMS_PIECE_BYTES = 1 << 20
"""Digest bytes per Checksums message: a long prompt's digests (8 bytes per route and block) come in several, each
well under the side channel's frame limit."""


@dataclass
class BatchTimes:
    """When one batch's bytes moved (wall clock, time.time(), comparable across processes on one machine)."""

    layers: list[int]
    nbytes: int
    posted: float
    """Its first gather or WRITE began."""
    written: float = 0.0
    """Every WRITE of it completed (direct: in decode's blocks; staged: in decode's staging slots)."""
    landed: float = 0.0
    """In decode's blocks: `written` for a direct WRITE; decode's answer to its last staged chunk otherwise."""
    staged_chunks: int = 0
    answers: int = 0


@dataclass(frozen=True)
class Pair:
    """One prefill rank -> one decode rank, for one request: what its descriptors, byte counts and rows are built
    from (BatchWriter.pair)."""

    src: Mapping[tuple[str, int], Region]
    dst: Mapping[tuple[str, int], Region]
    src_ids: Sequence[Sequence[int]]
    dst_ids: Sequence[Sequence[int]]
    unit: int
    """Tokens a span counts in."""
    full_block_size: int


@dataclass
class BatchWriter:
    me: LocalRank
    transport: KVTransport
    config: SenderConfig
    stats: SenderStats
    staged: StagedWriter | None = None
    timeline: dict[str, list[BatchTimes]] = field(default_factory=dict)
    """Per transfer id, when `config.record_timeline`: each batch's times (taken by the bench, else dropped with
    the request)."""
    copier: BlockCopier | None = None
    """Digests for `kv_checksum`, on the KV caches' device (made on first use)."""

    def __post_init__(self) -> None:
        if self.me.staging is not None:
            self.staged = StagedWriter(self.transport, self.me, self.config.write_timeout_s, self.stats.record_write,
                                       ring_slots=self.config.staging_ring_slots)

    def stage_below_bytes(self) -> int:
        return self.config.stage_below_bytes or (4 << 20 if self.me.mem_type == "VRAM" else 64 << 10)

    def pair(self, req: SendRequest, dest: Destination) -> Pair:
        """What a batch to `dest` moves in: both sides' regions, block ids and the span unit, in sub-blocks where
        the two sides' block sizes differ (connector.core.block_views; the expanded ids are kept per request)."""
        views = dest.peer.accepted.views
        if views is None:
            return Pair(self.me.by_key, dest.peer.accepted.regions, req.block_ids, dest.register.groups,
                        self.me.block_size, self.me.full_block_size)
        if dest.expanded is None or dest.expanded[0] is not req.block_ids:
            dest.expanded = (req.block_ids, views.src.expand(req.block_ids, self.me.null_block),
                             views.dst.expand(dest.register.groups, dest.peer.hello.null_block))
        return Pair(views.src.regions, views.dst.regions, dest.expanded[1], dest.expanded[2], views.unit,
                    views.full_block_size)

    def descriptors(self, req: SendRequest, dest: Destination, batch: list[tuple[int, int]]) -> Descriptors:
        spans = self._spans(dest, batch)
        cached = self._by_layer(req, dest, spans)
        if cached is not None:
            return cached.take(layer for layer, _ in batch)
        p = self.pair(req, dest)
        return batch_descriptors(p.src, p.dst, dest.layer_routes, spans, p.src_ids, p.dst_ids, self._nulls(dest),
                                 p.unit)

    def pool_bytes(self, req: SendRequest, dest: Destination, batch: list[tuple[int, int]]) -> dict[str, int]:
        """What `descriptors` of the same batch move, per pool."""
        spans = self._spans(dest, batch)
        cached = self._by_layer(req, dest, spans)
        if cached is not None:
            return cached.pool_bytes(layer for layer, _ in batch)
        p = self.pair(req, dest)
        return batch_pool_bytes(p.src, p.dst, dest.layer_routes, spans, p.dst_ids, dest.peer.hello.null_block, p.unit)

    def _by_layer(self, req: SendRequest, dest: Destination,
                  spans: list[tuple[int, int, int, bool]]) -> LayerDescriptors | None:
        """Every layer's descriptors for the block span the batch's layers share, built once per chunk (the first
        batch of a span builds them for all of `dest`'s layers, the next ones slice them); None when the layers'
        spans differ (a registration that came late, a restart), which takes the general path. The cache is keyed
        by the block-id lists themselves (a new chunk or a restart gives new ones) and the generation."""
        if not spans or any(span[1:] != spans[0][1:] for span in spans):
            return None
        key = (spans[0][1], spans[0][2], spans[0][3], req.generation)
        hit = dest.by_layer
        if hit is not None and hit[0] == key and hit[1] is req.block_ids:
            return hit[2]
        p = self.pair(req, dest)
        built = span_descriptors(p.src, p.dst, dest.layer_routes, key[0], key[1], p.src_ids, p.dst_ids,
                                 self._nulls(dest), final=key[2], unit=p.unit)
        dest.by_layer = (key, req.block_ids, built)
        return built

    def _nulls(self, dest: Destination) -> tuple[int, int]:
        """(prefill's, decode's) null block: positions decode's holds are not sent."""
        return self.me.null_block, dest.peer.hello.null_block

    def _spans(self, dest: Destination, batch: list[tuple[int, int]]) -> list[tuple[int, int, int, bool]]:
        """Each layer from its first unsent token's block (a block sent partly filled is sent again from its start
        once more tokens are in it) to the block of its last ready token; final once that is the last token decode
        wants (a per-request state, a ring or a Mamba state, moves then, whole)."""
        views = dest.peer.accepted.views
        bs = views.unit if views is not None else self.me.block_size
        first, end = dest.register.first_token, dest.register.num_tokens
        return [(layer, max(dest.sent_tokens.get(layer, 0), first) // bs, blocks_for(ready, bs), ready >= end)
                for layer, ready in batch]

    def checksums(self, req: SendRequest, dest: Destination) -> list[Checksums]:
        """What this rank wrote to `dest` for `req`, digested per route and block from its own blocks
        (connector.core.checksums), as Checksums messages of at most CHECKSUMS_PIECE_BYTES of digests each.
        Blocking (reads the KV caches): call it from a worker thread, after every WRITE to `dest` completed."""
        if self.copier is None:
            self.copier = BlockCopier(f"cuda:{self.me.device_id}" if self.me.mem_type == "VRAM" else "cpu")
        reg, p = dest.register, self.pair(req, dest)
        spans = transfer_spans(dest.layer_routes, reg.first_token, reg.num_tokens, p.unit, p.full_block_size)
        rows = source_rows(p.src, p.dst, dest.layer_routes, spans, p.src_ids, p.dst_ids, self._nulls(dest), p.unit)
        pieces: list[list[RouteDigests]] = [[]]
        size = 0
        for r in rows:
            digests = self.copier.digests(r.parts).astype("<u8").tobytes()
            if pieces[-1] and size + len(digests) > CHECKSUMS_PIECE_BYTES:
                pieces.append([])
                size = 0
            pieces[-1].append(RouteDigests(r.pool, r.layer, r.heads, digests))
            size += len(digests)
        return [Checksums(req.transfer_id, *self.me.rank, routes) for routes in pieces if routes]

    def unanswered(self, dest: Destination, transfer_id: str) -> int:
        """Staged chunks of `transfer_id` sent to `dest` that decode has not answered yet."""
        return self.staged.unanswered(dest.conn, transfer_id) if self.staged is not None else 0

    async def write(self, req: SendRequest, dest: Destination, batch: list[tuple[int, int]],
                    on_answer: Callable[[bool, str], None]) -> Descriptors:
        """Post `batch` to `dest`; returns its descriptors (the byte ranges moved) once every WRITE of it completed.
        Staged chunks are answered later, each to `on_answer(ok, reason)`."""
        descs = self.descriptors(req, dest, batch)
        if not len(descs):
            return descs
        times = BatchTimes([layer for layer, _ in batch], descs.nbytes, time.time())
        if self.config.record_timeline:
            self.timeline.setdefault(req.transfer_id, []).append(times)
        hello, reg = dest.peer.accepted.hello, dest.register
        # (staging gathers whole blocks' rows: a pair whose block sizes differ writes directly)
        if self.staged is not None and dest.peer.accepted.views is None \
                and self.staged.usable(dest.conn, reg, hello.staging_addr) \
                and len(descs) >= self.config.stage_min_descriptors \
                and descs.nbytes < len(descs) * self.stage_below_bytes():
            segments = batch_segments(self.me.by_key, dest.peer.accepted.regions, dest.layer_routes,
                                      self._spans(dest, batch), req.block_ids, reg.groups, self._nulls(dest),
                                      self.me.block_size)

            def answered(ok: bool, why: str) -> None:
                times.answers += 1
                times.landed = time.time()
                on_answer(ok, why)

            chunks = await self.staged.write(dest.conn, reg, dest.peer.agent, hello.staging_addr,
                                             hello.staging_device, req.transfer_id, segments, answered,
                                             stop=lambda: dest.done)
            times.staged_chunks = chunks
            dest.staged_chunks += chunks
            self.stats.staged_chunks += chunks
        else:
            local, remote = descs.arrays()
            self.stats.record_write(await self.transport.write(
                dest.peer.agent, local, remote, mem_type=self.me.mem_type, local_device=self.me.device_id,
                remote_device=dest.peer.accepted.device_id, timeout=self.config.write_timeout_s))
            times.landed = time.time()
        times.written = time.time()
        return descs
