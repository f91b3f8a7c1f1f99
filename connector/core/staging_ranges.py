"""Staged transfers, the pure half: chunking, the slot allocator of a staging buffer, and the check a receiver
runs before it scatters anything. No I/O, no torch (the copies are `connector.transport.device_copy`).

Why staging: a NIXL WRITE costs about 7-11 us per descriptor on a GPU (measured on an H200, UCX cuda_ipc): vLLM
hands out scattered blocks, so 4096 tokens of MiniMax-M3 are 45k descriptors and move at 1.4 GB/s, against 22 GB/s
when the same bytes sit in runs. A gather and a scatter are two device-memory copies (TB/s), so staging trades them
for almost all of the descriptor cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from connector.core.errors import StagingError
from connector.core.layout import Region


def chunks(lens: np.ndarray, max_bytes: int) -> list[tuple[int, int]]:
    """Split descriptors [0, n) into consecutive index ranges of at most `max_bytes` each. A single descriptor
    larger than that is the caller's to split first (`split_long`)."""
    out, start, total = [], 0, 0
    for i, n in enumerate(lens.tolist()):
        if n > max_bytes:
            raise ValueError(f"descriptor {i} holds {n} B, more than a staging chunk of {max_bytes} B")
        if total + n > max_bytes and i > start:
            out.append((start, i))
            start, total = i, 0
        total += n
    if start < len(lens):
        out.append((start, len(lens)))
    return out


def split_long(local: np.ndarray, remote: np.ndarray, max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Descriptor arrays ([n, 3]: addr, len, device) with every descriptor longer than `max_bytes` cut into pieces."""
    lens = local[:, 1]
    if not (lens > max_bytes).any():
        return local, remote
    pieces = np.maximum(1, -(-lens // max_bytes))
    idx = np.repeat(np.arange(len(lens)), pieces)
    offset = (np.arange(len(idx)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * max_bytes
    piece_len = np.minimum(lens[idx] - offset, max_bytes)
    out = []
    for arr in (local, remote):
        new = arr[idx].copy()
        new[:, 0] += offset
        new[:, 1] = piece_len
        out.append(new)
    return out[0], out[1]


@dataclass
class Slots:
    """Fixed-size slots of a staging buffer of `total_bytes` (offsets only; the memory is the caller's)."""

    total_bytes: int
    slot_bytes: int
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.slot_bytes <= 0 or self.total_bytes < self.slot_bytes:
            self.free = []
        else:
            self.free = [i * self.slot_bytes for i in range(self.total_bytes // self.slot_bytes)][::-1]

    def take(self) -> int | None:
        """A free slot's offset, or None when all are in use (the caller then writes directly)."""
        return self.free.pop() if self.free else None

    def give_back(self, offset: int) -> None:
        if offset in self.free or offset % self.slot_bytes or offset >= self.total_bytes:
            raise ValueError(f"staging slot {offset} is not an allocated slot")
        self.free.append(offset)


def allowed_ranges(regions: list[Region], block_ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (starts, ends) of every byte range a transfer may write: each part of each registered block of each
    region. A staged chunk's destinations must each fall inside one of them."""
    starts, lens = [], []
    for r in regions:
        if r.group >= len(block_ids) or not block_ids[r.group]:
            continue
        blocks = np.asarray(block_ids[r.group], dtype=np.int64)
        for part in range(r.num_parts):
            starts.append(r.base_addr + part * r.part_stride + blocks * r.block_stride)
            lens.append(np.full(len(blocks), r.bytes_per_block, dtype=np.int64))
    if not starts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    s, n = np.concatenate(starts), np.concatenate(lens)
    order = np.argsort(s, kind="stable")
    s, e = s[order], s[order] + n[order]
    # Merge ranges that touch: registered blocks adjacent in memory form one run, and the sender coalesces a run
    # into one descriptor that crosses block boundaries.
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
    bad = (i < 0) | (dst + lens > ends[np.maximum(i, 0)])
    if bad.any():
        k = int(np.nonzero(bad)[0][0])
        raise StagingError(f"{int(bad.sum())} staged destination(s) fall outside the blocks registered for this "
                           f"transfer (first: {int(lens[k])} B at {int(dst[k]):#x})")
