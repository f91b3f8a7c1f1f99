"""Optional end-to-end integrity (`kv_checksum`): what each decode rank holds after a transfer, per (pool, global
layer, block), against what prefill sent. Pure: which rows each side digests, the digests on the wire, and the
comparison. The digests themselves run where the memory is (`connector.transport.device_copy.BlockCopier.digests`).

Why per route and per block: a decode block may be filled by several prefill ranks (prefill TP larger than
decode's: each writes its heads' slice of it), so each prefill rank's digests cover only its slice of each block, and
decode digests the same slice. Both sides derive the rows from the plan and the registration alone (prefill from
its source blocks, decode from its destination blocks), never from the descriptors, so a coalesced, split or staged
WRITE digests the same. A mismatch names the pool, layer, heads and decode block ids. A request's last block, when
the transfer fills it only partly, is not covered (`transfer_spans`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from connector.core.block_views import view_runs
from connector.core.descriptors import NO_NULL_BLOCK, group_range, head_span, live_pairs, span_parts
from connector.core.layout import Region
from connector.core.plan import Rank, Route
from connector.core.staging_ranges import Rows


@dataclass(frozen=True)
class RouteRows:
    """One route's rows on one side: what a digest per block covers."""

    pool: str
    layer: int
    heads: tuple[int, int]
    parts: tuple[Rows, ...]
    """One Rows per region part (K, V), each with the same blocks in the same order."""
    dst_blocks: np.ndarray
    """Decode's block id of each digest (what a mismatch names), int64."""

    @property
    def key(self) -> tuple[str, int, tuple[int, int]]:
        return self.pool, self.layer, self.heads


def transfer_spans(layer_routes: Mapping[int, Sequence[Route]], first_token: int, num_tokens: int,
                   block_size: int, full_block_size: int = 0) -> list[tuple[int, int, int, bool]]:
    """(global layer, first block, end block, final) of what the checksums cover: every block a transfer of tokens
    [first_token, num_tokens) fills completely in every pool (`full_block_size`: the lcm of the paged caches' block
    sizes, a multiple of `block_size`, the unit), every layer routed, and every per-request state. Not the last,
    partly filled block: prefill may still write there (the KV of tokens after the prompt, when it generates more
    than one) while or after it is sent, and decode never reads those slots as they came (it computes the prompt's
    last token itself)."""
    whole = max(full_block_size, block_size)
    first, end = first_token // block_size, num_tokens // whole * (whole // block_size)
    return [(layer, first, max(first, end), True) for layer in sorted(layer_routes)]


def region_rows(region: Region, block_ids: np.ndarray, heads: tuple[int, int]) -> tuple[Rows, ...]:
    """The rows of `heads` in blocks `block_ids` of `region`, one Rows per part (per part and run of a view in
    sub-blocks, in the order `descriptors.pieces` lists them, which both sides share)."""
    offset, nbytes = head_span(region, heads)
    if not region.is_view:
        return tuple(Rows(region.base_addr + p * region.part_stride + offset, region.block_stride, nbytes, block_ids)
                     for p in range(region.num_parts))
    out = []
    k = region.sub_blocks
    for p in range(region.num_parts):
        for runs in view_runs(region):
            # rows at a stride that both the blocks' and the sub-blocks' steps divide
            stride = math.gcd(region.block_stride, runs.nbytes)
            ids = (block_ids // k * region.block_stride + block_ids % k * runs.nbytes) // stride
            base = region.base_addr + p * region.part_stride + offset
            out.extend(Rows(base + int(run), stride, runs.nbytes, ids) for run in runs.offsets)
    return tuple(out)


def source_rows(src_regions: Mapping[tuple[str, int], Region], dst_regions: Mapping[tuple[str, int], Region],
                layer_routes: Mapping[int, Sequence[Route]], spans: Sequence[tuple[int, int, int]],
                src_blocks: Sequence[Sequence[int]], dst_blocks: Sequence[Sequence[int]],
                nulls: tuple[int, int] = (NO_NULL_BLOCK, NO_NULL_BLOCK), unit: int = 0) -> list[RouteRows]:
    """Prefill's side: the source rows of every route to one decode rank, paired with decode's blocks exactly as
    the WRITEs pair them (`live_pairs`: decode's null block receives nothing)."""
    out = []
    for span in spans:
        layer, b0, b1, final = span_parts(span)
        for r in layer_routes[layer]:
            src, dst = src_regions[(r.pool, layer)], dst_regions[(r.pool, layer)]
            s_ids, d_ids = live_pairs(src_blocks[src.group][group_range(src, b0, b1, final, unit)],
                                      dst_blocks[dst.group][group_range(dst, b0, b1, final, unit)], nulls,
                                      f"{r.pool} layer {layer}: ")
            out.append(RouteRows(r.pool, layer, r.heads, region_rows(src, s_ids, r.heads), d_ids))
    return out


def destination_rows(dst_regions: Mapping[tuple[str, int], Region], layer_routes: Mapping[int, Sequence[Route]],
                     spans: Sequence[tuple[int, int, int]], dst_blocks: Sequence[Sequence[int]],
                     dst_null: int = NO_NULL_BLOCK, unit: int = 0) -> list[RouteRows]:
    """Decode's side: the destination rows of every route from one prefill rank (its null block excluded, which
    prefill does not write)."""
    out = []
    for span in spans:
        layer, b0, b1, final = span_parts(span)
        for r in layer_routes[layer]:
            dst = dst_regions[(r.pool, layer)]
            d_ids = np.asarray(dst_blocks[dst.group][group_range(dst, b0, b1, final, unit)], dtype=np.int64)
            if dst_null != NO_NULL_BLOCK:
                d_ids = d_ids[d_ids != dst_null]
            out.append(RouteRows(r.pool, layer, r.heads, region_rows(dst, d_ids, r.heads), d_ids))
    return out


def mismatch(src: Rank, expected: Sequence[RouteRows], local: Sequence[np.ndarray],
             sent: Mapping[tuple[str, int, tuple[int, int]], bytes]) -> str:
    """An empty string when decode's digests (`local`, one uint64 array per route of `expected`) equal what prefill
    rank `src` sent (`sent`: route key -> little-endian uint64 digests), else a message naming the first few
    differences."""
    problems = []
    for rows, mine in zip(expected, local):
        got = sent.get(rows.key)
        what = f"{rows.pool} layer {rows.layer} heads {rows.heads[0]}-{rows.heads[1] - 1}"
        if got is None:
            if rows.dst_blocks.size:
                problems.append(f"{what}: prefill sent no checksum for it")
            continue
        theirs = np.frombuffer(got, dtype="<u8")
        if theirs.shape != mine.shape:
            problems.append(f"{what}: prefill sent {theirs.size} block checksums, decode holds {mine.size} blocks")
            continue
        bad = np.flatnonzero(theirs != mine)
        if bad.size:
            shown = rows.dst_blocks[bad[:8]].tolist()
            problems.append(f"{what}: decode blocks {shown}{' ...' if bad.size > 8 else ''} ({bad.size} of "
                            f"{mine.size})")
    if not problems:
        return ""
    more = f" (and {len(problems) - 4} more routes)" if len(problems) > 4 else ""
    return (f"kv_checksum: what decode holds from prefill rank {src} is not what it sent: " + "; ".join(problems[:4])
            + more + ". The bytes changed between prefill's blocks and decode's (prefill overwrote blocks it was "
            "sending, decode reused blocks it was receiving, or the link or a device corrupted them)")
