"""Block ids -> (addr, len) descriptor lists for one route. Pure, no I/O.

Descriptor count is the performance lever (a NIXL WRITE costs 7-11 us per descriptor VRAM->VRAM on an H200, ~3 us
between two processes' DRAM: docs/internals.md, "Staged transfers"), so runs of blocks that are contiguous on BOTH
sides are merged into one descriptor. Source and destination descriptors are returned pairwise equal in length,
ready for one NIXL WRITE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from connector.core.block_views import view_runs
from connector.core.errors import DescriptorError
from connector.core.layout import Region
from connector.core.plan import Route


@dataclass(frozen=True)
class Descriptors:
    """Pairwise descriptors: src_addrs[i] -> dst_addrs[i], lengths[i] bytes. numpy uint64/int64 arrays."""

    src_addrs: np.ndarray
    dst_addrs: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(src Nx2, dst Nx2) uint64 arrays of (addr, nbytes): the fast form the transport takes."""
        return np.stack([self.src_addrs, self.lengths], axis=1), np.stack([self.dst_addrs, self.lengths], axis=1)

    def pairs(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(src [(addr, len)], dst [(addr, len)]) as Python lists (tests, small requests)."""
        lens = self.lengths.tolist()
        return list(zip(self.src_addrs.tolist(), lens)), list(zip(self.dst_addrs.tolist(), lens))

    @staticmethod
    def concat(parts: Sequence["Descriptors"]) -> "Descriptors":
        if not parts:
            return EMPTY
        return Descriptors(np.concatenate([p.src_addrs for p in parts]),
                           np.concatenate([p.dst_addrs for p in parts]),
                           np.concatenate([p.lengths for p in parts]))


EMPTY = Descriptors(np.zeros(0, np.uint64), np.zeros(0, np.uint64), np.zeros(0, np.uint64))


NULL_BLOCK = 0
"""vLLM's null block: BlockPool keeps block 0 out of every allocation and puts it where a request needs no block,
such as the positions a sliding-window layer's window has left behind (v1/core/single_type_kv_cache_manager.py
remove_skipped_blocks). A rank says it has one (LocalRank.null_block, Hello.null_block); elsewhere, in the demo
and the Python API, block 0 is a block like any other."""
NO_NULL_BLOCK = -1
"""A rank with no null block: every block id holds data."""


def blocks_moved(old: Sequence[Sequence[int]], new: Sequence[Sequence[int]], null_block: int = NO_NULL_BLOCK) -> bool:
    """Did a request's blocks move between two steps (vLLM preempted it and recomputes it elsewhere)? A position
    that became the null block did not move: its tokens left a sliding window, so nothing reads them any more."""
    return any(n != o and n != null_block for new_g, old_g in zip(new, old) for n, o in zip(new_g, old_g))


def live_pairs(src_blocks: Sequence[int] | np.ndarray, dst_blocks: Sequence[int] | np.ndarray,
               nulls: tuple[int, int] = (NO_NULL_BLOCK, NO_NULL_BLOCK),
               what: str = "") -> tuple[np.ndarray, np.ndarray]:
    """The (source, destination) block pairs to copy. Decode's null block wants nothing: vLLM put it where the
    tokens lie outside a sliding window when decode allocated (it never reads them). A null source under a live
    destination is a block prefill no longer holds but decode will read: an error, not a silent gap. (Pairs of
    unequal length are passed through for check_route to refuse.)"""
    s_ids, d_ids = np.asarray(src_blocks, dtype=np.int64), np.asarray(dst_blocks, dtype=np.int64)
    if s_ids.shape != d_ids.shape or nulls == (NO_NULL_BLOCK, NO_NULL_BLOCK):
        return s_ids, d_ids
    live = d_ids != nulls[1]
    lost = live & (s_ids == nulls[0])
    if lost.any():
        raise DescriptorError(f"{what}decode reads block positions {np.nonzero(lost)[0][:8].tolist()} that prefill "
                              f"no longer holds (vLLM freed them as outside its sliding window): the two sides' "
                              f"sliding windows differ")
    return (s_ids, d_ids) if live.all() else (s_ids[live], d_ids[live])


Span = tuple
"""(global layer, first block, end block[, final]): blocks [first, end) in units of the rank's block size (the gcd
of its paged caches' block sizes, `LocalRank.block_size`), `final` when the request's last token to send is in
them (what a per-request state waits for; False when left out)."""


def span_parts(span: Span) -> tuple[int, int, int, bool]:
    return (span[0], span[1], span[2], bool(span[3])) if len(span) > 3 else (span[0], span[1], span[2], False)


def group_range(region: Region, b0: int, b1: int, final: bool = False, unit: int = 0) -> slice:
    """Which of the request's block ids in `region`'s KV-cache group blocks [b0, b1) of `unit` tokens cover: the
    same blocks when the region's block size is the unit (or either is unknown, 0); whole blocks of a larger size
    (a partly covered one included, sent again when it fills); for a per-request state, once `final`, the block that
    holds it: the last before the speculative scratch blocks (a ring's one block; a Mamba state's running block, after
    the placeholders and superseded states vLLM leaves before it: kv_connector/utils.py clip_ssm_state_blocks)."""
    if region.per_request:
        if not final:
            return slice(0, 0)
        scratch = region.scratch_blocks
        return slice(-(scratch + 1), -scratch if scratch else None)
    if not unit or not region.block_size or region.block_size == unit:
        return slice(b0, b1)
    if region.block_size % unit:
        raise DescriptorError(f"{region.pool} layer {region.layer} has blocks of {region.block_size} tokens, not a "
                              f"multiple of the rank's unit of {unit}")
    per = region.block_size // unit
    return slice(b0 // per, -(-b1 // per))


def check_blocks(region: Region, block_ids: Sequence[int] | np.ndarray, who: str = "") -> np.ndarray:
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise DescriptorError(f"{who}block ids must be a flat list, got shape {ids.shape}")
    bad = ids[(ids < 0) | (ids >= region.num_blocks)]
    if bad.size:
        raise DescriptorError(f"{who}block ids {sorted(set(bad.tolist()))[:8]} are outside {region.pool} layer "
                              f"{region.layer}'s {region.num_blocks} blocks (valid 0..{region.num_blocks - 1})")
    return ids


def head_span(region: Region, heads: tuple[int, int]) -> tuple[int, int]:
    """(byte offset inside a block, bytes) of global heads [first, end) in `region` (head-major blocks)."""
    first, end = heads
    if not (region.heads[0] <= first < end <= region.heads[1]):
        raise DescriptorError(f"heads {first}-{end - 1} are not all held by {region.pool} layer {region.layer} "
                              f"(it holds heads {region.heads[0]}-{region.heads[1] - 1})")
    if (first, end) != region.heads and not region.head_major:
        raise DescriptorError(f"{region.pool} layer {region.layer} is not head-major (NHD) so heads {first}-{end - 1} "
                              f"of {region.heads[0]}-{region.heads[1] - 1} cannot be cut out of a block: use the HND "
                              f"KV-cache layout when prefill and decode TP sizes differ")
    per_head = region.bytes_per_head_per_block
    if region.head_stride and end - first > 1:
        raise DescriptorError(f"{region.pool} layer {region.layer}: heads {first}-{end - 1} of a block cut into "
                              f"smaller blocks are not contiguous: move them head by head (block_views.split_routes)")
    return (first - region.heads[0]) * (region.head_stride or per_head), (end - first) * per_head


def block_addresses(region: Region, block_ids: np.ndarray, offset: int) -> np.ndarray:
    """Address of `offset` inside each block of each part, part-major: shape (num_parts * len(block_ids),). Not
    for a view (`pieces`)."""
    parts = np.arange(region.num_parts, dtype=np.int64)[:, None] * region.part_stride
    addrs = region.base_addr + parts + block_ids[None, :] * region.block_stride + offset
    return addrs.reshape(-1).astype(np.uint64)


def pieces(region: Region, block_ids: np.ndarray, heads: tuple[int, int]) -> list[tuple[np.ndarray, int]]:
    """What `heads` of blocks `block_ids` are in memory: (address of each piece, bytes per piece), per set of pieces
    of one size. A region that is not a view is one piece per (part, block); a view in sub-blocks
    (connector.core.block_views) is, per segment of its token layout, one piece per (part, block, run)."""
    offset, nbytes = head_span(region, heads)
    if not region.is_view:
        return [(block_addresses(region, block_ids, offset), nbytes)]
    k = region.sub_blocks
    parts = np.arange(region.num_parts, dtype=np.int64)[:, None] * region.part_stride
    starts = region.base_addr + parts + (block_ids // k * region.block_stride + offset)[None, :]
    out = []
    for runs in view_runs(region):
        addrs = (starts + block_ids % k * runs.nbytes)[:, :, None] + runs.offsets[None, None, :]
        out.append((addrs.reshape(-1).astype(np.uint64), runs.nbytes))
    return out


def paired_pieces(src: Region, dst: Region, s_ids: np.ndarray, d_ids: np.ndarray,
                  heads: tuple[int, int]) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """`pieces` of both sides, relative to each region's base address, paired: (source offsets, destination
    offsets, bytes per piece) per set. A view pairs only with a view of the same token layout."""
    s_sets, d_sets = pieces(src, s_ids, heads), pieces(dst, d_ids, heads)
    if [(a.size, n) for a, n in s_sets] != [(a.size, n) for a, n in d_sets]:
        raise DescriptorError(f"{src.pool} layer {src.layer}: prefill's blocks move as {len(s_sets)} set(s) of pieces "
                              f"and decode's as {len(d_sets)} of other sizes: their token layouts or block sizes "
                              f"differ (connector.core.block_views)")
    return [(sa - np.uint64(src.base_addr), da - np.uint64(dst.base_addr), n)
            for (sa, n), (da, _) in zip(s_sets, d_sets)]


def check_route(src: Region, dst: Region, src_blocks: Sequence[int] | np.ndarray,
                dst_blocks: Sequence[int] | np.ndarray,
                heads: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """The checks every route copy needs (same region, same parts, blocks in range and paired, heads the same size
    on both sides): (source block ids, destination block ids, source offset, destination offset, bytes per block)."""
    if src.key != dst.key:
        raise DescriptorError(f"route pairs {src.key} with {dst.key}: regions must be the same (pool, layer)")
    if src.num_parts != dst.num_parts:
        raise DescriptorError(f"{src.pool} layer {src.layer} has {src.num_parts} part(s) on prefill but "
                              f"{dst.num_parts} on decode: the KV cache layouts differ")
    s_ids = check_blocks(src, src_blocks, "source ")
    d_ids = check_blocks(dst, dst_blocks, "destination ")
    if s_ids.shape != d_ids.shape:
        raise DescriptorError(f"{src.pool} layer {src.layer}: {s_ids.size} source blocks but {d_ids.size} "
                              f"destination blocks")
    s_off, s_len = head_span(src, heads)
    d_off, d_len = head_span(dst, heads)
    if s_len != d_len:
        raise DescriptorError(f"{src.pool} layer {src.layer}: heads {heads} are {s_len} B per block on prefill "
                              f"but {d_len} B on decode: block sizes or dtypes differ")
    return s_ids, d_ids, s_off, d_off, s_len


def route_descriptors(src: Region, dst: Region, src_blocks: Sequence[int] | np.ndarray,
                      dst_blocks: Sequence[int] | np.ndarray, heads: tuple[int, int]) -> Descriptors:
    """Descriptors that copy `heads` of src block src_blocks[i] into dst block dst_blocks[i], every part.

    Runs contiguous on both sides are coalesced: the result has one descriptor per run, not per block."""
    s_ids, d_ids, _, _, _ = check_route(src, dst, src_blocks, dst_blocks, heads)
    if s_ids.size == 0:
        return EMPTY
    s_base, d_base = np.uint64(src.base_addr), np.uint64(dst.base_addr)
    return Descriptors.concat([coalesce(s_base + s_rel, d_base + d_rel, nbytes)
                               for s_rel, d_rel, nbytes in paired_pieces(src, dst, s_ids, d_ids, heads)])


def geometry(region: Region) -> tuple:
    """Everything about a region but its address: regions with equal geometry can be computed together."""
    return (region.pool, region.num_blocks, region.bytes_per_block, region.block_stride, region.num_parts,
            region.part_stride, region.heads, region.head_major, region.group, region.sub_blocks, region.head_stride,
            region.token_layout, region.block_size)


def layers_descriptors(srcs: Sequence[Region], dsts: Sequence[Region], src_blocks: Sequence[int] | np.ndarray,
                       dst_blocks: Sequence[int] | np.ndarray, heads: tuple[int, int]) -> Descriptors:
    """`route_descriptors` for many layers at once (their regions share geometry, see `geometry`), in one
    vectorised pass: the same as concatenating the per-layer results, layer by layer, but ~50x cheaper."""
    if not srcs:
        return EMPTY
    first = route_descriptors(srcs[0], dsts[0], src_blocks, dst_blocks, heads)  # validates once
    if len(srcs) == 1 or not len(first):
        return first
    if any(geometry(r) != geometry(srcs[0]) for r in srcs) or any(geometry(r) != geometry(dsts[0]) for r in dsts):
        return Descriptors.concat([route_descriptors(a, b, src_blocks, dst_blocks, heads) for a, b in zip(srcs, dsts)])
    s_ids, d_ids = np.asarray(src_blocks, dtype=np.int64), np.asarray(dst_blocks, dtype=np.int64)
    s_base = np.array([r.base_addr for r in srcs], dtype=np.uint64)[:, None]
    d_base = np.array([r.base_addr for r in dsts], dtype=np.uint64)[:, None]
    return Descriptors.concat([coalesce((s_base + s_rel).reshape(-1), (d_base + d_rel).reshape(-1), nbytes)
                               for s_rel, d_rel, nbytes in paired_pieces(srcs[0], dsts[0], s_ids, d_ids, heads)])


def batch_descriptors(src_regions: Mapping[tuple[str, int], Region], dst_regions: Mapping[tuple[str, int], Region],
                      layer_routes: Mapping[int, Sequence[Route]], spans: Iterable[tuple[int, int, int]],
                      src_blocks: Sequence[Sequence[int]], dst_blocks: Sequence[Sequence[int]],
                      nulls: tuple[int, int] = (NO_NULL_BLOCK, NO_NULL_BLOCK), unit: int = 0) -> Descriptors:
    """Descriptors of one WRITE from one prefill rank to one decode rank: for each `(global layer, first block,
    end block)` in `spans`, every route of that layer, blocks [first, end) of each side's block-id group, but
    where decode has its null block (`nulls`: prefill's and decode's, see `live_pairs`).

    The one function that turns a batch into descriptors (the sender's WRITEs and the bench's raw-NIXL baseline
    both use it, so they move the same descriptors). Layers that move the same block range with the same geometry
    are computed in one vectorised pass (`layers_descriptors`)."""
    groups: dict[tuple, tuple[list[Region], list[Region], tuple[int, int], slice, slice]] = {}
    for span in spans:
        layer, b0, b1, final = span_parts(span)
        for r in layer_routes[layer]:
            src, dst = src_regions[(r.pool, layer)], dst_regions[(r.pool, layer)]
            s_range, d_range = group_range(src, b0, b1, final, unit), group_range(dst, b0, b1, final, unit)
            key = (geometry(src), geometry(dst), r.heads, s_range.start, s_range.stop, d_range.start, d_range.stop)
            groups.setdefault(key, ([], [], r.heads, s_range, d_range))
            groups[key][0].append(src)
            groups[key][1].append(dst)
    return Descriptors.concat([
        layers_descriptors(srcs, dsts, *live_pairs(src_blocks[srcs[0].group][s_range],
                                                   dst_blocks[dsts[0].group][d_range],
                                                   nulls, f"{srcs[0].pool} layer {srcs[0].layer}: "), heads)
        for srcs, dsts, heads, s_range, d_range in groups.values()])


@dataclass(frozen=True)
class LayerDescriptors:
    """One block span's descriptors for many layers at once, kept layer by layer: layer L's are
    `descs[bounds[L][0]:bounds[L][1]]`, and no descriptor crosses from one layer into another, so any set of layers
    is a few slices. Built once per chunk and destination (`span_descriptors`), then a layer's WRITE only slices it:
    the per-layer work on the loop is O(1) numpy calls instead of the ~30 that building took (350 us for M3's 768
    descriptors a layer, issue 32)."""

    descs: Descriptors
    bounds: dict[int, tuple[int, int]]
    layer_pool_bytes: dict[int, dict[str, int]]
    """Per layer, the bytes each pool moves (what `batch_pool_bytes` says for the same span)."""

    def take(self, layers: Iterable[int]) -> Descriptors:
        """The descriptors of `layers` (each one this object covers), in layer order."""
        runs: list[list[int]] = []
        for first, end in sorted(self.bounds[layer] for layer in layers):
            if runs and runs[-1][1] == first:
                runs[-1][1] = end
            else:
                runs.append([first, end])
        d = self.descs
        if len(runs) == 1:
            first, end = runs[0]
            return Descriptors(d.src_addrs[first:end], d.dst_addrs[first:end], d.lengths[first:end])
        rows = np.concatenate([np.arange(first, end) for first, end in runs]) if runs else np.zeros(0, np.int64)
        return Descriptors(d.src_addrs[rows], d.dst_addrs[rows], d.lengths[rows])

    def pool_bytes(self, layers: Iterable[int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for layer in layers:
            for pool, nbytes in self.layer_pool_bytes[layer].items():
                out[pool] = out.get(pool, 0) + nbytes
        return out


def span_descriptors(src_regions: Mapping[tuple[str, int], Region], dst_regions: Mapping[tuple[str, int], Region],
                     layer_routes: Mapping[int, Sequence[Route]], b0: int, b1: int,
                     src_blocks: Sequence[Sequence[int]], dst_blocks: Sequence[Sequence[int]],
                     nulls: tuple[int, int] = (NO_NULL_BLOCK, NO_NULL_BLOCK), final: bool = False,
                     unit: int = 0) -> LayerDescriptors:
    """`batch_descriptors` of blocks [b0, b1) for every layer of `layer_routes`, layer by layer (LayerDescriptors):
    the same byte ranges, except that a run never continues from one layer's region into the next's. Layers with
    equal geometry are computed in one vectorised pass, as there."""
    groups: dict[tuple, tuple[list[Region], list[Region], tuple[int, int]]] = {}
    for layer, routes in layer_routes.items():
        for r in routes:
            src, dst = src_regions[(r.pool, layer)], dst_regions[(r.pool, layer)]
            srcs, dsts, _heads = groups.setdefault((geometry(src), geometry(dst), r.heads), ([], [], r.heads))
            srcs.append(src)
            dsts.append(dst)
    parts, layer_of, pool_bytes = [], [], {layer: {} for layer in layer_routes}
    for srcs, dsts, heads in groups.values():
        s_range, d_range = group_range(srcs[0], b0, b1, final, unit), group_range(dsts[0], b0, b1, final, unit)
        s_ids, d_ids = live_pairs(src_blocks[srcs[0].group][s_range], dst_blocks[dsts[0].group][d_range], nulls,
                                  f"{srcs[0].pool} layer {srcs[0].layer}: ")
        check_route(srcs[0], dsts[0], s_ids, d_ids, heads)  # every check a route needs, once per group
        for r in srcs:  # (a pool with no live block moves 0 bytes, and says so, as batch_pool_bytes does)
            pool_bytes[r.layer].setdefault(r.pool, 0)
        if s_ids.size == 0:
            continue
        s_base = np.array([r.base_addr for r in srcs], dtype=np.uint64)[:, None]
        d_base = np.array([r.base_addr for r in dsts], dtype=np.uint64)[:, None]
        layers = np.array([r.layer for r in srcs], dtype=np.int64)
        for s_rel, d_rel, length in paired_pieces(srcs[0], dsts[0], s_ids, d_ids, heads):
            descs, rows = _coalesce_rows((s_base + s_rel).reshape(-1), (d_base + d_rel).reshape(-1), length,
                                         s_rel.size)
            parts.append(descs)
            layer_of.append(layers[rows])
            for r in srcs:
                pool_bytes[r.layer][r.pool] = pool_bytes[r.layer].get(r.pool, 0) + length * s_rel.size
    if not parts:
        return LayerDescriptors(EMPTY, {layer: (0, 0) for layer in layer_routes}, pool_bytes)
    layers = np.concatenate(layer_of)
    order = np.argsort(layers, kind="stable")
    d = Descriptors.concat(parts)
    d = Descriptors(d.src_addrs[order], d.dst_addrs[order], d.lengths[order])
    ordered = layers[order]
    keys = np.array(sorted(layer_routes), dtype=np.int64)
    firsts, ends = np.searchsorted(ordered, keys, "left"), np.searchsorted(ordered, keys, "right")
    return LayerDescriptors(d, {int(k): (int(a), int(b)) for k, a, b in zip(keys, firsts, ends)}, pool_bytes)


def _coalesce_rows(src_addrs: np.ndarray, dst_addrs: np.ndarray, length: int,
                   row_len: int) -> tuple[Descriptors, np.ndarray]:
    """`coalesce` of a flattened matrix whose rows must stay apart (one row per layer): also each run's row."""
    n = src_addrs.shape[0]
    step = np.uint64(length)
    breaks = np.ones(n, dtype=bool)
    breaks[1:] = (src_addrs[1:] != src_addrs[:-1] + step) | (dst_addrs[1:] != dst_addrs[:-1] + step)
    breaks[::row_len] = True
    starts = np.flatnonzero(breaks)
    run_lengths = np.diff(np.append(starts, n)).astype(np.uint64) * step
    return Descriptors(src_addrs[starts], dst_addrs[starts], run_lengths), starts // row_len


def batch_pool_bytes(src_regions: Mapping[tuple[str, int], Region], dst_regions: Mapping[tuple[str, int], Region],
                     layer_routes: Mapping[int, Sequence[Route]], spans: Iterable[tuple[int, int, int]],
                     dst_blocks: Sequence[Sequence[int]], dst_null: int = NO_NULL_BLOCK,
                     unit: int = 0) -> dict[str, int]:
    """Bytes per pool that `batch_descriptors` moves for the same spans (what each pool costs on the wire; the
    sum over pools equals the descriptors' nbytes): decode's null blocks move nothing."""
    out: dict[str, int] = {}
    live: dict[tuple[int, int | None, int | None], int] = {}
    """(group, first, end) -> blocks decode holds data in: counted once per span, not per route and layer."""

    def live_blocks(group: int, blocks: slice) -> int:
        if (group, blocks.start, blocks.stop) not in live:
            ids = np.asarray(dst_blocks[group][blocks])
            live[(group, blocks.start, blocks.stop)] = int(ids.size if dst_null == NO_NULL_BLOCK
                                                           else np.count_nonzero(ids != dst_null))
        return live[(group, blocks.start, blocks.stop)]

    for span in spans:
        layer, b0, b1, final = span_parts(span)
        for r in layer_routes[layer]:
            src, dst = src_regions[(r.pool, layer)], dst_regions[(r.pool, layer)]
            blocks = live_blocks(dst.group, group_range(dst, b0, b1, final, unit))
            out[r.pool] = out.get(r.pool, 0) + blocks * head_span(src, r.heads)[1] * src.num_parts
    return out


def coalesce(src_addrs: np.ndarray, dst_addrs: np.ndarray, length: int) -> Descriptors:
    """Merge consecutive equal-length pieces that continue each other on both sides."""
    n = src_addrs.shape[0]
    if n == 0:
        return EMPTY
    step = np.uint64(length)
    breaks = np.ones(n, dtype=bool)
    breaks[1:] = (src_addrs[1:] != src_addrs[:-1] + step) | (dst_addrs[1:] != dst_addrs[:-1] + step)
    starts = np.flatnonzero(breaks)
    run_lengths = np.diff(np.append(starts, n)).astype(np.uint64) * step
    return Descriptors(src_addrs[starts], dst_addrs[starts], run_lengths)


def split_pieces(descs: Descriptors, piece_bytes: int) -> Descriptors:
    """The same byte ranges cut into pieces of at most `piece_bytes` (the bench's threaded baseline: NIXL spreads a
    WRITE over its threads only once it has enough descriptors)."""
    if piece_bytes <= 0:
        raise DescriptorError(f"piece_bytes must be > 0, not {piece_bytes}")
    lengths = descs.lengths.astype(np.int64)
    counts = -(-lengths // piece_bytes)
    row = np.repeat(np.arange(len(descs)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offsets = (np.arange(row.shape[0]) - first) * piece_bytes
    sizes = np.minimum(piece_bytes, lengths[row] - offsets)
    off = offsets.astype(np.uint64)
    return Descriptors(descs.src_addrs[row] + off, descs.dst_addrs[row] + off, sizes.astype(np.uint64))
