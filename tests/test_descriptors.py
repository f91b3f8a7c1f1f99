"""Descriptors: block ids -> coalesced (addr, len) pairs, applied to real buffers and checked byte for byte."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core.descriptors import route_descriptors
from connector.core.errors import DescriptorError
from connector.core.layout import Region


def buffer_region(buf: np.ndarray, pool: str, layer: int, heads: tuple[int, int], parts: int,
                  padding: int = 0) -> Region:
    """Region over `buf` shaped (parts, blocks, heads, bytes_per_head) uint8, with `padding` bytes between blocks
    emulated by a larger per-block stride (the buffer's last axis carries it)."""
    n_parts, n_blocks, n_heads, per_head = buf.shape
    assert n_parts == parts and n_heads == heads[1] - heads[0]
    bytes_per_block = n_heads * per_head - padding
    return Region(pool=pool, layer=layer, slot=0, base_addr=buf.ctypes.data, num_blocks=n_blocks,
                  bytes_per_block=bytes_per_block, block_stride=n_heads * per_head, heads=heads,
                  num_parts=parts, part_stride=n_blocks * n_heads * per_head)


def apply(descs, src_buf: np.ndarray, dst_buf: np.ndarray) -> None:
    """Do what a NIXL WRITE would, with memmove, after checking every range is inside the buffers."""
    s_lo, d_lo = src_buf.ctypes.data, dst_buf.ctypes.data
    for s, d, n in zip(descs.src_addrs.tolist(), descs.dst_addrs.tolist(), descs.lengths.tolist()):
        assert s_lo <= s and s + n <= s_lo + src_buf.nbytes
        assert d_lo <= d and d + n <= d_lo + dst_buf.nbytes
        ctypes.memmove(d, s, n)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_route_copies_exactly_the_requested_heads_of_the_requested_blocks(data):
    parts = data.draw(st.sampled_from([1, 2]))
    total_heads = data.draw(st.sampled_from([1, 2, 4, 8]))
    src_tp = data.draw(st.sampled_from([t for t in (1, 2, 4, 8) if total_heads % t == 0]))
    dst_tp = data.draw(st.sampled_from([t for t in (1, 2, 4, 8) if total_heads % t == 0]))
    src_rank, dst_rank = data.draw(st.integers(0, src_tp - 1)), data.draw(st.integers(0, dst_tp - 1))
    s_heads = (src_rank * total_heads // src_tp, (src_rank + 1) * total_heads // src_tp)
    d_heads = (dst_rank * total_heads // dst_tp, (dst_rank + 1) * total_heads // dst_tp)
    lo, hi = max(s_heads[0], d_heads[0]), min(s_heads[1], d_heads[1])
    if lo >= hi:
        return
    per_head = data.draw(st.sampled_from([4, 16, 64]))
    n_src, n_dst = data.draw(st.integers(1, 24)), data.draw(st.integers(1, 24))
    count = data.draw(st.integers(0, min(n_src, n_dst)))
    src_ids = data.draw(st.permutations(range(n_src)))[:count]
    dst_ids = data.draw(st.permutations(range(n_dst)))[:count]
    if data.draw(st.booleans()):  # contiguous runs are the common case: make some
        src_ids, dst_ids = sorted(src_ids), sorted(dst_ids)
    rng = np.random.default_rng(count)
    src = rng.integers(0, 255, (parts, n_src, s_heads[1] - s_heads[0], per_head), dtype=np.uint8)
    dst = np.zeros((parts, n_dst, d_heads[1] - d_heads[0], per_head), dtype=np.uint8)
    descs = route_descriptors(buffer_region(src, "kv", 5, s_heads, parts), buffer_region(dst, "kv", 5, d_heads, parts),
                              src_ids, dst_ids, (lo, hi))
    apply(descs, src, dst)
    expect = np.zeros_like(dst)
    for s_b, d_b in zip(src_ids, dst_ids):
        expect[:, d_b, lo - d_heads[0]:hi - d_heads[0]] = src[:, s_b, lo - s_heads[0]:hi - s_heads[0]]
    assert np.array_equal(dst, expect)
    assert descs.nbytes == parts * count * (hi - lo) * per_head


def test_contiguous_runs_become_one_descriptor_each():
    src = np.zeros((1, 64, 1, 256), np.uint8)
    dst = np.zeros((1, 64, 1, 256), np.uint8)
    rs, rd = buffer_region(src, "index_k", 3, (0, 1), 1), buffer_region(dst, "index_k", 3, (0, 1), 1)
    # runs on both sides: [0..9]->[20..29], [10..14]->[40..44], [30]->[0]
    src_ids = list(range(0, 15)) + [30]
    dst_ids = list(range(20, 30)) + list(range(40, 45)) + [0]
    descs = route_descriptors(rs, rd, src_ids, dst_ids, (0, 1))
    assert len(descs) == 3
    assert descs.lengths.tolist() == [10 * 256, 5 * 256, 256]


def test_k_and_v_halves_are_separate_runs():
    src = np.zeros((2, 16, 4, 32), np.uint8)
    dst = np.zeros((2, 16, 4, 32), np.uint8)
    descs = route_descriptors(buffer_region(src, "kv", 0, (0, 4), 2), buffer_region(dst, "kv", 0, (0, 4), 2),
                              [2, 3, 4], [7, 8, 9], (0, 4))
    assert len(descs) == 2  # one run in K, one in V
    assert descs.lengths.tolist() == [3 * 128, 3 * 128]


def test_head_slice_inside_blocks_cannot_coalesce_across_blocks():
    src = np.zeros((2, 8, 4, 32), np.uint8)   # prefill tp1: heads 0-3
    dst = np.zeros((2, 8, 2, 32), np.uint8)   # decode tp2 rank 1: heads 2-3
    descs = route_descriptors(buffer_region(src, "kv", 0, (0, 4), 2), buffer_region(dst, "kv", 0, (2, 4), 2),
                              [0, 1, 2], [0, 1, 2], (2, 4))
    assert len(descs) == 6  # gaps on the source side between blocks
    assert set(descs.lengths.tolist()) == {64}


def test_padded_block_stride_is_respected():
    src = np.zeros((1, 8, 1, 64), np.uint8)
    dst = np.zeros((1, 8, 1, 64), np.uint8)
    region = buffer_region(src, "index_k", 1, (0, 1), 1, padding=16)
    descs = route_descriptors(region, buffer_region(dst, "index_k", 1, (0, 1), 1, padding=16), [0, 1], [0, 1], (0, 1))
    assert descs.lengths.tolist() == [48, 48]  # stride 64 > 48 bytes per block: no merge


@pytest.mark.parametrize("src_ids, dst_ids, heads, match", [
    ([0, 16], [0, 1], (0, 4), r"source block ids \[16\] are outside kv layer 0's 16 blocks"),
    ([0, 1], [-1, 1], (0, 4), r"destination block ids \[-1\]"),
    ([0, 1], [0], (0, 4), "2 source blocks but 1 destination"),
    ([0], [0], (2, 6), "heads 2-5 are not all held"),
])
def test_bad_input_is_refused_before_anything_is_built(src_ids, dst_ids, heads, match):
    buf = np.zeros((2, 16, 4, 8), np.uint8)
    region = buffer_region(buf, "kv", 0, (0, 4), 2)
    with pytest.raises(DescriptorError, match=match):
        route_descriptors(region, region, src_ids, dst_ids, heads)


def test_mismatched_block_size_is_named():
    a = buffer_region(np.zeros((1, 4, 1, 64), np.uint8), "index_k", 3, (0, 1), 1)
    b = buffer_region(np.zeros((1, 4, 1, 32), np.uint8), "index_k", 3, (0, 1), 1)
    with pytest.raises(DescriptorError, match="64 B per block on prefill but 32 B on decode"):
        route_descriptors(a, b, [0], [0], (0, 1))


def test_many_layers_at_once_equal_layer_by_layer():
    from connector.core.descriptors import Descriptors, layers_descriptors

    bufs_src = [np.zeros((2, 32, 2, 16), np.uint8) for _ in range(5)]
    bufs_dst = [np.zeros((2, 32, 2, 16), np.uint8) for _ in range(5)]
    srcs = [buffer_region(b, "kv", i, (0, 2), 2) for i, b in enumerate(bufs_src)]
    dsts = [buffer_region(b, "kv", i, (0, 2), 2) for i, b in enumerate(bufs_dst)]
    src_ids, dst_ids = [3, 4, 5, 9, 1], [7, 8, 9, 0, 31]
    one_by_one = Descriptors.concat([route_descriptors(a, b, src_ids, dst_ids, (1, 2)) for a, b in zip(srcs, dsts)])
    together = layers_descriptors(srcs, dsts, src_ids, dst_ids, (1, 2))
    for field in ("src_addrs", "dst_addrs", "lengths"):
        assert getattr(together, field).tolist() == getattr(one_by_one, field).tolist()


def test_bytes_per_pool_add_up_to_what_the_descriptors_move():
    from connector.core.descriptors import batch_descriptors, batch_pool_bytes
    from connector.core.plan import Endpoint, Route

    # kv: two heads, K and V parts, the route carries head 1 only; index_k: one head, one part.
    kv_src, kv_dst = np.zeros((2, 16, 2, 32), np.uint8), np.zeros((2, 16, 1, 32), np.uint8)
    ik_src, ik_dst = np.zeros((1, 16, 1, 8), np.uint8), np.zeros((1, 16, 1, 8), np.uint8)
    src = {("kv", 3): buffer_region(kv_src, "kv", 3, (0, 2), 2), ("index_k", 3): buffer_region(ik_src, "index_k", 3,
                                                                                              (0, 1), 1)}
    dst = {("kv", 3): buffer_region(kv_dst, "kv", 3, (1, 2), 2), ("index_k", 3): buffer_region(ik_dst, "index_k", 3,
                                                                                              (0, 1), 1)}
    end = Endpoint(0, 0, 0)
    routes = {3: [Route("kv", 3, end, end, (1, 2), 0), Route("index_k", 3, end, end, (0, 1), 0)]}
    spans = [(3, 1, 5)]  # blocks 1-4 of each side's list
    blocks = [[2, 3, 9, 10, 11, 0]]
    by_pool = batch_pool_bytes(src, dst, routes, spans, blocks)
    assert by_pool == {"kv": 4 * 32 * 2, "index_k": 4 * 8}
    assert sum(by_pool.values()) == batch_descriptors(src, dst, routes, spans, blocks, blocks).nbytes


def test_split_pieces_covers_the_same_bytes_in_pieces_no_larger_than_asked():
    from connector.core.descriptors import Descriptors, split_pieces

    descs = Descriptors(np.array([1000, 50, 7000], np.uint64), np.array([90, 5000, 300], np.uint64),
                        np.array([10, 3, 8], np.uint64))
    out = split_pieces(descs, 4)
    assert out.src_addrs.tolist() == [1000, 1004, 1008, 50, 7000, 7004]
    assert out.dst_addrs.tolist() == [90, 94, 98, 5000, 300, 304]
    assert out.lengths.tolist() == [4, 4, 2, 3, 4, 4]
    assert out.nbytes == descs.nbytes
    with pytest.raises(DescriptorError, match="piece_bytes must be > 0"):
        split_pieces(descs, 0)


def test_blocks_moved_tells_a_preemption_from_a_window_that_left_blocks_behind():
    from connector.core.descriptors import NULL_BLOCK, blocks_moved

    full, window = [5, 6, 7], [8, 9, 10]
    assert not blocks_moved([full, window], [full + [11], window + [12]])  # grown by a chunk
    # a sliding-window group's first blocks became vLLM's null block: not a move (nothing reads them again)
    assert not blocks_moved([full, window], [full + [11], [NULL_BLOCK, NULL_BLOCK, 10, 12]], NULL_BLOCK)
    assert blocks_moved([full, window], [[5, 20, 7], window], NULL_BLOCK)  # recomputed into another block: a move
    assert blocks_moved([full, [NULL_BLOCK, 9]], [full, [NULL_BLOCK, 30]], NULL_BLOCK)
    # a rank without a null block (the demo, the Python API): block 0 is data, a change to it is a move
    assert blocks_moved([full, window], [full, [NULL_BLOCK, 9, 10]])


def test_decode_null_blocks_are_not_written_and_a_null_source_under_a_live_destination_is_refused():
    from connector.core.descriptors import NULL_BLOCK, batch_descriptors, batch_pool_bytes, live_pairs
    from connector.core.errors import DescriptorError
    from connector.core.plan import Endpoint, Route

    # vLLM's sliding-window layers: decode allocated its null block where the window had left the tokens behind
    src_ids, dst_ids = [7, 8, 9, 10], [NULL_BLOCK, NULL_BLOCK, 4, 5]
    s, d = live_pairs(src_ids, dst_ids, (NULL_BLOCK, NULL_BLOCK))
    assert s.tolist() == [9, 10] and d.tolist() == [4, 5]
    # without null blocks (the demo, the Python API) block 0 is a block like any other
    s, d = live_pairs(src_ids, dst_ids)
    assert d.tolist() == dst_ids
    with pytest.raises(DescriptorError, match=r"decode reads block positions \[1\] that prefill no longer holds"):
        live_pairs([7, NULL_BLOCK, 9], [3, 4, 5], (NULL_BLOCK, NULL_BLOCK))
    kv_src, kv_dst = np.zeros((2, 16, 1, 32), np.uint8), np.zeros((2, 16, 1, 32), np.uint8)  # K and V, one head
    src = {("kv", 0): buffer_region(kv_src, "kv", 0, (0, 1), 2)}
    dst = {("kv", 0): buffer_region(kv_dst, "kv", 0, (0, 1), 2)}
    end = Endpoint(0, 0, 0)
    routes = {0: [Route("kv", 0, end, end, (0, 1), 0)]}
    spans = [(0, 0, 4)]
    descs = batch_descriptors(src, dst, routes, spans, [src_ids], [dst_ids], (NULL_BLOCK, NULL_BLOCK))
    by_pool = batch_pool_bytes(src, dst, routes, spans, [dst_ids], NULL_BLOCK)
    assert descs.nbytes == by_pool["kv"] == 2 * 2 * 32  # two live blocks, K and V


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_chunks_descriptors_built_once_slice_to_what_each_batch_would_build(data):
    """The sender builds a chunk's descriptors for every layer once (span_descriptors) and slices each batch out of
    them: for any set of layers, the same bytes go from the same places to the same places as batch_descriptors,
    and the same bytes per pool. Layers share one buffer back to back (runs could cross from one layer into the next:
    they must not), two pools of different geometry, null blocks on decode."""
    from connector.core.descriptors import NULL_BLOCK, batch_descriptors, batch_pool_bytes, span_descriptors
    from connector.core.plan import Endpoint, Route

    n_layers, n_blocks = data.draw(st.integers(1, 5)), 12
    kv_src = np.arange(n_layers * 2 * n_blocks * 2 * 8, dtype=np.uint64).astype(np.uint8).reshape(
        n_layers, 2, n_blocks, 2, 8)
    kv_dst = np.zeros_like(kv_src)
    ik_src = (np.arange(n_layers * n_blocks * 4, dtype=np.uint64) * 7).astype(np.uint8).reshape(
        n_layers, 1, n_blocks, 1, 4)
    ik_dst = np.zeros_like(ik_src)
    sparse = [layer for layer in range(n_layers) if layer % 2 == 1]  # index_k on odd layers only
    src, dst, routes = {}, {}, {}
    end = Endpoint(0, 0, 0)
    for layer in range(n_layers):
        src[("kv", layer)] = buffer_region(kv_src[layer], "kv", layer, (0, 2), 2)
        dst[("kv", layer)] = buffer_region(kv_dst[layer], "kv", layer, (0, 2), 2)
        routes[layer] = [Route("kv", layer, end, end, (0, 2), 0)]
        if layer in sparse:
            src[("index_k", layer)] = buffer_region(ik_src[layer], "index_k", layer, (0, 1), 1)
            dst[("index_k", layer)] = buffer_region(ik_dst[layer], "index_k", layer, (0, 1), 1)
            routes[layer].append(Route("index_k", layer, end, end, (0, 1), 0))
    count = data.draw(st.integers(1, n_blocks - 1))
    src_ids = data.draw(st.lists(st.integers(1, n_blocks - 1), min_size=count, max_size=count, unique=True))
    dst_ids = data.draw(st.lists(st.integers(0, n_blocks - 1), min_size=count, max_size=count, unique=True))
    b0 = data.draw(st.integers(0, count - 1))
    b1 = data.draw(st.integers(b0, count))
    layers = data.draw(st.lists(st.sampled_from(range(n_layers)), min_size=1, unique=True))
    nulls = (NULL_BLOCK, NULL_BLOCK)
    built = span_descriptors(src, dst, routes, b0, b1, [src_ids], [dst_ids], nulls)
    spans = [(layer, b0, b1) for layer in layers]
    want = batch_descriptors(src, dst, routes, spans, [src_ids], [dst_ids], nulls)
    got = built.take(layers)
    assert built.pool_bytes(layers) == batch_pool_bytes(src, dst, routes, spans, [dst_ids], NULL_BLOCK)
    assert got.nbytes == want.nbytes
    results = []
    for descs in (want, got):  # each WRITE into zeroed decode buffers, as NIXL would
        kv_dst[:], ik_dst[:] = 0, 0
        for s, d, n in zip(descs.src_addrs.tolist(), descs.dst_addrs.tolist(), descs.lengths.tolist()):
            assert any(b.ctypes.data <= d and d + n <= b.ctypes.data + b.nbytes for b in (kv_dst, ik_dst))
            ctypes.memmove(d, s, n)
        results.append((kv_dst.copy(), ik_dst.copy()))
    assert all(np.array_equal(a, b) for a, b in zip(*results))
    for layer, (first, stop) in built.bounds.items():  # no run leaves its own layer's regions
        mine = [r for key, r in src.items() if key[1] == layer]
        for s, n in zip(built.descs.src_addrs[first:stop].tolist(), built.descs.lengths[first:stop].tolist()):
            assert any(r.base_addr <= s and s + n <= r.base_addr + r.part_stride * r.num_parts for r in mine)
