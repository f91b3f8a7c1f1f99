"""Staged transfers, the pure half: what a staged chunk holds (rows of region parts, block by block), how a batch is
cut into chunks, the byte allocator of a staging buffer, and the check a receiver runs before it scatters anything.
No I/O, no torch (the copies are `connector.transport.device_copy`).

Why staging: a NIXL WRITE costs about 7-11 us per descriptor on a GPU (measured on an H200, UCX cuda_ipc) and about
2.5 us on DRAM: vLLM hands out scattered blocks, so 4096 tokens of MiniMax-M3 are 45k descriptors and move at
1.2-1.6 GB/s on the H200, against 750-810 GB/s when the same bytes sit in 117 large descriptors. A gather and a
scatter are two device-memory copies (TB/s on a GPU), so staging trades them for almost all of the descriptor cost.

Why rows of blocks: a region part (K or V of one layer) is an array of equal-size blocks, so moving some of its
blocks is an `index_select` of block ids over a `[num_blocks, row_bytes]` view on prefill and an index copy on
decode: one kernel per region part, with an index of one entry per block (not per byte or word).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from connector.core.descriptors import NO_NULL_BLOCK, check_route, group_range, live_pairs, span_parts
from connector.core.errors import StagingError
from connector.core.layout import Region
from connector.core.plan import Route


@dataclass(frozen=True)
class Rows:
    """Equal-size rows of one side of a region part: row k is `row_bytes` at `addr + blocks[k] * stride`."""

    addr: int
    """Address of block 0's row (the region part's base plus the head slice's offset inside a block)."""
    stride: int
    """Bytes from one block's row to the next block's (the region's block stride)."""
    row_bytes: int
    blocks: np.ndarray
    """Block ids, int64."""

    @property
    def nbytes(self) -> int:
        return int(self.blocks.size) * self.row_bytes

    def starts(self) -> np.ndarray:
        """Address of every row, int64."""
        return self.addr + self.blocks * self.stride

    def take(self, first: int, end: int) -> "Rows":
        return Rows(self.addr, self.stride, self.row_bytes, self.blocks[first:end])


@dataclass(frozen=True)
class Segment:
    """The same rows on both sides: `src` on prefill, `dst` on decode (`src.blocks[k]` goes to `dst.blocks[k]`)."""

    src: Rows
    dst: Rows

    @property
    def nbytes(self) -> int:
        return self.src.nbytes

    def take(self, first: int, end: int) -> "Segment":
        return Segment(self.src.take(first, end), self.dst.take(first, end))


def route_segments(src: Region, dst: Region, src_blocks: Sequence[int] | np.ndarray,
                   dst_blocks: Sequence[int] | np.ndarray, heads: tuple[int, int]) -> list[Segment]:
    """One Segment per part (K, V) that copies `heads` of src block src_blocks[i] into dst block dst_blocks[i]: the
    block-wise twin of `connector.core.descriptors.route_descriptors`, with the same checks."""
    s_ids, d_ids, s_off, d_off, nbytes = check_route(src, dst, src_blocks, dst_blocks, heads)
    if not s_ids.size:
        return []
    return [Segment(Rows(src.base_addr + p * src.part_stride + s_off, src.block_stride, nbytes, s_ids),
                    Rows(dst.base_addr + p * dst.part_stride + d_off, dst.block_stride, nbytes, d_ids))
            for p in range(src.num_parts)]


def batch_segments(src_regions: Mapping[tuple[str, int], Region], dst_regions: Mapping[tuple[str, int], Region],
                   layer_routes: Mapping[int, Sequence[Route]], spans: Iterable[tuple[int, int, int]],
                   src_blocks: Sequence[Sequence[int]], dst_blocks: Sequence[Sequence[int]],
                   nulls: tuple[int, int] = (NO_NULL_BLOCK, NO_NULL_BLOCK), unit: int = 0) -> list[Segment]:
    """The segments of one staged batch, the same bytes as `connector.core.descriptors.batch_descriptors` for the
    same arguments: for each `(global layer, first block, end block)`, every route of that layer."""
    out: list[Segment] = []
    for span in spans:
        layer, b0, b1, final = span_parts(span)
        for r in layer_routes[layer]:
            src, dst = src_regions[(r.pool, layer)], dst_regions[(r.pool, layer)]
            out += route_segments(src, dst, *live_pairs(src_blocks[src.group][group_range(src, b0, b1, final, unit)],
                                                        dst_blocks[dst.group][group_range(dst, b0, b1, final, unit)],
                                                        nulls, f"{r.pool} layer {layer}: "), r.heads)
    return out


def chunk_segments(segments: Sequence[Segment], max_bytes: int) -> list[list[Segment]]:
    """Cut `segments` into chunks of at most `max_bytes` each, in order; a segment may be split between two chunks
    (at a row boundary). Raises StagingError when a single row is larger than `max_bytes`."""
    out: list[list[Segment]] = []
    current: list[Segment] = []
    room = max_bytes
    for seg in segments:
        row = seg.src.row_bytes
        if row > max_bytes:
            raise StagingError(f"a block row of {row} B does not fit a staging chunk of {max_bytes} B: give each "
                               f"connection a larger staging slot (staging_slot_mb) or write directly")
        first, n = 0, int(seg.src.blocks.size)
        while first < n:
            take = min(n - first, room // row)
            if take == 0:
                out.append(current)
                current, room = [], max_bytes
                continue
            current.append(seg.take(first, first + take))
            first += take
            room -= take * row
    if current:
        out.append(current)
    return out


def chunk_destinations(rows: Sequence[Rows]) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of every row of a chunk's destination side, int64, in packing order."""
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.concatenate([r.starts() for r in rows])
    lens = np.concatenate([np.full(r.blocks.size, r.row_bytes, np.int64) for r in rows])
    return starts, lens


class Extents:
    """First-fit allocator of byte extents in a buffer of `total_bytes` (offsets only; the memory is the caller's).
    Every extent starts at a multiple of `align_bytes`."""

    def __init__(self, total_bytes: int, align_bytes: int = 4096) -> None:
        self.total_bytes, self.align_bytes = total_bytes, align_bytes
        self.free: list[tuple[int, int]] = [(0, total_bytes)] if total_bytes > 0 else []
        """Free (offset, size), sorted by offset, never touching each other."""
        self.taken: dict[int, int] = {}

    @property
    def largest_free(self) -> int:
        return max((size for _, size in self.free), default=0)

    def take(self, nbytes: int) -> int | None:
        """Offset of a free extent of `nbytes` (rounded up to the alignment), or None when none is free."""
        need = -(-max(1, nbytes) // self.align_bytes) * self.align_bytes
        for i, (offset, size) in enumerate(self.free):
            if size >= need:
                if size == need:
                    del self.free[i]
                else:
                    self.free[i] = (offset + need, size - need)
                self.taken[offset] = need
                return offset
        return None

    def give_back(self, offset: int) -> None:
        size = self.taken.pop(offset, None)
        if size is None:
            raise ValueError(f"staging extent {offset} is not allocated")
        self.free.append((offset, size))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for off, sz in self.free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + sz)
            else:
                merged.append((off, sz))
        self.free = merged


def allowed_ranges(regions: Sequence[Region], block_ids: list[list[int]],
                   null_block: int = NO_NULL_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (starts, ends) of every byte range a transfer may write: each part of each registered block of each
    region. A staged chunk's destinations must each fall inside one of them."""
    starts, lens = [], []
    for r in regions:
        if r.group >= len(block_ids) or not block_ids[r.group]:
            continue
        blocks = np.asarray(block_ids[r.group], dtype=np.int64)
        blocks = blocks[blocks != null_block]  # decode wants nothing there (outside a sliding window)
        for part in range(r.num_parts):
            starts.append(r.base_addr + part * r.part_stride + blocks * r.block_stride)
            lens.append(np.full(len(blocks), r.bytes_per_block, dtype=np.int64))
    if not starts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    s, n = np.concatenate(starts), np.concatenate(lens)
    order = np.argsort(s, kind="stable")
    s, e = s[order], s[order] + n[order]
    # Merge ranges that touch: registered blocks adjacent in memory form one run, and a row may be checked as one.
    reach = np.maximum.accumulate(e)
    fresh = np.ones(len(s), dtype=bool)
    fresh[1:] = s[1:] > reach[:-1]
    first = np.nonzero(fresh)[0]
    return s[first], np.maximum.reduceat(e, first)


def check_destinations(dst: np.ndarray, lens: np.ndarray, allowed: tuple[np.ndarray, np.ndarray]) -> None:
    """Raise StagingError unless every [dst[i], dst[i] + lens[i]) lies inside one allowed range."""
    starts, ends = allowed
    if not len(dst):
        return
    if not len(starts):
        raise StagingError("no blocks are registered for this transfer here")
    i = np.searchsorted(starts, dst, side="right") - 1
    bad = (i < 0) | (dst + lens > ends[np.maximum(i, 0)]) | (lens <= 0)
    if bad.any():
        k = int(np.nonzero(bad)[0][0])
        raise StagingError(f"{int(bad.sum())} staged destination(s) fall outside the blocks registered for this "
                           f"transfer (first: {int(lens[k])} B at {int(dst[k]):#x})")
