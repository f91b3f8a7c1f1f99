"""Staging: the block-wise copies (connector.transport.device_copy, CPU here; tests/test_gpu.py runs them on CUDA),
the pure half (connector.core.staging_ranges: segments, chunks, extents, the destination check), and the reader's
refusals (connector.engine.staging), each on real memory."""

from __future__ import annotations

import asyncio
import ctypes
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core.errors import StagedWriteError, StagingError
from connector.core.layout import Region
from connector.core.staging_ranges import (Extents, Rows, Segment, allowed_ranges, check_destinations,
                                           chunk_segments, route_segments)
from connector.engine.staging import StagedReader, _Lane
from connector.protocol.messages import Scatter, StagedRows
from connector.transport.device_copy import BlockCopier
from tests.test_descriptors import apply, buffer_region

CPU = BlockCopier("cpu")


def through_staging(segments: list[Segment], staging: np.ndarray, copier: BlockCopier = CPU) -> None:
    """What a staged transfer does to memory: gather every chunk on one side, scatter it on the other."""
    for chunk in chunk_segments(segments, staging.nbytes):
        copier.gather([s.src for s in chunk], staging.ctypes.data)
        copier.scatter([s.dst for s in chunk], staging.ctypes.data)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_segments_through_staging_move_exactly_what_the_descriptors_move(data):
    """Block-wise gather + scatter of a route's segments leaves the destination byte for byte as the route's
    descriptors (applied with memmove) do: head slices of any TP split, K/V parts, padded block strides, block
    sizes that are not word multiples, chunks that split a region part."""
    parts = data.draw(st.sampled_from([1, 2]))
    total_heads = data.draw(st.sampled_from([1, 2, 4]))
    src_tp, dst_tp = (data.draw(st.sampled_from([t for t in (1, 2, 4) if total_heads % t == 0])) for _ in "sd")
    s_rank, d_rank = data.draw(st.integers(0, src_tp - 1)), data.draw(st.integers(0, dst_tp - 1))
    s_heads = (s_rank * total_heads // src_tp, (s_rank + 1) * total_heads // src_tp)
    d_heads = (d_rank * total_heads // dst_tp, (d_rank + 1) * total_heads // dst_tp)
    heads = (max(s_heads[0], d_heads[0]), min(s_heads[1], d_heads[1]))
    if heads[0] >= heads[1]:
        return
    per_head = data.draw(st.sampled_from([3, 8, 64]))
    n_src, n_dst = data.draw(st.integers(1, 20)), data.draw(st.integers(1, 20))
    count = data.draw(st.integers(1, min(n_src, n_dst)))
    src_ids = data.draw(st.permutations(range(n_src)))[:count]
    dst_ids = data.draw(st.permutations(range(n_dst)))[:count]
    rng = np.random.default_rng(count)
    src = rng.integers(0, 255, (parts, n_src, s_heads[1] - s_heads[0], per_head), dtype=np.uint8)
    want = np.zeros((parts, n_dst, d_heads[1] - d_heads[0], per_head), dtype=np.uint8)
    got = np.zeros_like(want)
    s_reg, d_want = buffer_region(src, "kv", 0, s_heads, parts), buffer_region(want, "kv", 0, d_heads, parts)
    d_got = buffer_region(got, "kv", 0, d_heads, parts)
    from connector.core.descriptors import route_descriptors

    apply(route_descriptors(s_reg, d_want, src_ids, dst_ids, heads), src, want)
    row = (heads[1] - heads[0]) * per_head
    staging = np.zeros(row * data.draw(st.integers(1, 2 * count)), dtype=np.uint8)
    through_staging(route_segments(s_reg, d_got, src_ids, dst_ids, heads), staging)
    assert np.array_equal(got, want)


def test_block_copies_on_views_of_separate_layers_and_nothing_else():
    """Many region parts (60 layers x K/V) in one chunk: every row lands where its block id says, the staging
    buffer holds them packed in order, and no other block changes."""
    rng = np.random.default_rng(7)
    row, nb, sel = 2048, 40, 16
    src = torch.from_numpy(rng.integers(0, 255, (60, 2, nb, row), dtype=np.uint8))
    dst = torch.zeros_like(src)
    stage = torch.zeros(60 * 2 * sel * row, dtype=torch.uint8)
    s_ids, d_ids = rng.choice(nb, sel, replace=False), rng.choice(nb, sel, replace=False)
    src_rows = [Rows(src[l, p].data_ptr(), row, row, s_ids) for l in range(60) for p in range(2)]
    CPU.gather(src_rows, stage.data_ptr())
    assert torch.equal(stage.view(60, 2, sel, row), src[:, :, s_ids])
    CPU.scatter([Rows(dst[l, p].data_ptr(), row, row, d_ids) for l in range(60) for p in range(2)], stage.data_ptr())
    assert torch.equal(dst[:, :, d_ids], src[:, :, s_ids])
    untouched = torch.ones(nb, dtype=torch.bool)
    untouched[torch.from_numpy(d_ids)] = False
    assert int(dst[:, :, untouched].count_nonzero()) == 0


def test_block_copies_beat_the_per_range_memmove_loop_on_cpu():
    """The issue's bar for CPU memory: block-wise copies (one kernel per region part) beat the per-range memmove
    loop they replace. MiniMax-M3 rows (16 KiB K or V of a block), 256 of 520 blocks, 30 layers x K/V; best of 7
    each, interleaved, so other load on the machine hits both alike."""
    rng = np.random.default_rng(0)
    row, nb, sel, layers = 16384, 520, 256, 30
    src = torch.from_numpy(rng.integers(0, 255, (layers * 2, nb, row), dtype=np.uint8))
    stage = torch.zeros(layers * 2 * sel * row, dtype=torch.uint8)
    ids = rng.choice(nb, sel, replace=False)
    rows = [Rows(src[k].data_ptr(), row, row, ids) for k in range(layers * 2)]

    def memmove(gather: bool) -> None:
        move, at = ctypes.memmove, stage.data_ptr()
        for r in rows:
            for b in r.blocks.tolist():
                a, s = r.addr + b * r.stride, at
                move(*((s, a) if gather else (a, s)), row)
                at += row

    kinds = {"gather": (lambda: CPU.gather(rows, stage.data_ptr()), lambda: memmove(True)),
             "scatter": (lambda: CPU.scatter(rows, stage.data_ptr()), lambda: memmove(False))}
    best = {(k, i): float("inf") for k in kinds for i in (0, 1)}
    for _ in range(7):
        for k, fns in kinds.items():
            for i, fn in enumerate(fns):
                t0 = time.perf_counter()
                fn()
                best[k, i] = min(best[k, i], time.perf_counter() - t0)
    for k in kinds:
        assert best[k, 0] < best[k, 1], f"{k}: block-wise {best[k, 0] * 1e3:.1f} ms, memmove {best[k, 1] * 1e3:.1f} ms"


def test_chunks_split_segments_at_row_boundaries():
    def seg(n: int, row: int) -> Segment:
        ids = np.arange(n, dtype=np.int64)
        return Segment(Rows(0, row, row, ids), Rows(0, row, row, ids))

    chunks = chunk_segments([seg(5, 10), seg(2, 25), seg(1, 10)], 40)
    assert [[(len(s.src.blocks), s.src.row_bytes) for s in c] for c in chunks] == \
        [[(4, 10)], [(1, 10), (1, 25)], [(1, 25), (1, 10)]]
    assert all(sum(s.nbytes for s in c) <= 40 for c in chunks)
    assert chunks[1][0].src.blocks.tolist() == [4]  # the fifth row of the first segment
    with pytest.raises(StagingError, match="row of 50 B does not fit a staging chunk of 40 B"):
        chunk_segments([seg(1, 50)], 40)


def test_extents_first_fit_aligned_and_merged():
    ext = Extents(10 * 4096)
    a, b, c = ext.take(1), ext.take(4096 * 2), ext.take(4096 * 3)
    assert (a, b, c) == (0, 4096, 3 * 4096) and ext.largest_free == 4 * 4096
    assert ext.take(5 * 4096) is None
    ext.give_back(b)
    assert ext.take(4096) == 4096  # first fit: the hole b left
    ext.give_back(a)
    ext.give_back(4096)
    ext.give_back(c)
    assert ext.free == [(0, 10 * 4096)]  # neighbours merge back into one
    with pytest.raises(ValueError):
        ext.give_back(c)


async def test_lane_slots_are_credits_handed_out_in_order():
    lane = _Lane(base=4096, nbytes=4 * 4096 + 100, ring_slots=4)
    assert lane.slot_bytes == 4096 and list(lane.free) == [0, 4096, 8192, 12288]
    taken = [await lane.take(1.0) for _ in range(4)]
    waiter = asyncio.create_task(lane.take(1.0))
    await asyncio.sleep(0)
    assert not waiter.done()  # no credit left: waits for decode to answer
    lane.give(taken[2])
    assert await waiter == taken[2]
    with pytest.raises(StagedWriteError, match="no staging slot came free within 0.05 s"):
        await lane.take(0.05)
    assert _Lane(0, 5000, 4).slot_bytes == 5000  # too small to cut: one slot


def test_destination_check_accepts_registered_blocks_only():
    kv = Region(pool="kv", layer=0, slot=0, base_addr=0x10000, num_blocks=8, bytes_per_block=256, block_stride=256,
                heads=(0, 4), num_parts=2, part_stride=8 * 256, device_id=0, group=0, head_major=True)
    idx = Region(pool="index_k", layer=0, slot=0, base_addr=0x90000, num_blocks=8, bytes_per_block=64,
                 block_stride=64, heads=(0, 1), num_parts=1, part_stride=0, device_id=0, group=0, head_major=True)
    allowed = allowed_ranges([kv, idx], [[2, 5]])
    # inside: K and V halves of blocks 2 and 5, a head slice of one, and the index blocks
    ok = np.array([0x10000 + 2 * 256, 0x10000 + 8 * 256 + 5 * 256 + 128, 0x90000 + 5 * 64])
    check_destinations(ok, np.array([256, 128, 64]), allowed)
    for addr, n in [(0x10000 + 3 * 256, 16),            # block 3 was not registered
                    (0x10000 + 2 * 256 + 200, 100),      # runs past the end of block 2
                    (0x90000 + 6 * 64, 64), (0x100, 8)]:  # another block; memory of no region
        with pytest.raises(StagingError, match="outside the blocks registered"):
            check_destinations(np.array([addr]), np.array([n]), allowed)
    # a run of registered blocks adjacent in memory is one range: a row may cross block bounds inside it
    run = allowed_ranges([idx], [[3, 4, 5, 7]])
    check_destinations(np.array([0x90000 + 3 * 64]), np.array([3 * 64]), run)
    with pytest.raises(StagingError):
        check_destinations(np.array([0x90000 + 5 * 64]), np.array([2 * 64]), run)  # block 6 is not registered
    with pytest.raises(StagingError, match="no blocks"):
        check_destinations(np.array([0x10000]), np.array([8]), allowed_ranges([kv], [[]]))


class _Me:
    """The part of a LocalRank a StagedReader reads."""

    def __init__(self, staging: torch.Tensor) -> None:
        self.staging = staging
        self.staging_addr, self.staging_bytes = staging.data_ptr(), staging.numel()


async def test_reader_refuses_bad_chunks_and_writes_nothing():
    """Every refusal of decode's scatter leaves the cache untouched: rows outside the registered blocks, rows that
    do not add up to the chunk, a chunk past its connection's area, malformed or repeated block ids."""
    cache = np.zeros((2, 8, 256), dtype=np.uint8)  # K/V, 8 blocks of 256 B
    region = buffer_region(cache.reshape(2, 8, 1, 256), "kv", 0, (0, 1), 2)
    reader = StagedReader(_Me(torch.full((1 << 16,), 7, dtype=torch.uint8)), area_bytes=1 << 15)
    area = reader.take_area(connections=1)
    assert area == (0, 1 << 15) and reader.take_area(1) == (1 << 15, 1 << 15) and reader.take_area(1) is None
    allowed = allowed_ranges([region], [[2, 5]])

    def rows(blocks: list[int], addr: int = region.base_addr, row: int = 256, stride: int = 256) -> StagedRows:
        return StagedRows(addr, stride, row, np.array(blocks, dtype="<i8").tobytes())

    bad = [(Scatter("t", 0, 512, [rows([2, 3])]), "outside the blocks registered"),
           (Scatter("t", 1, 256, [rows([2, 5])]), "does not match its rows"),
           (Scatter("t", 2, 512, [rows([2, 5])], slot_offset=(1 << 15) - 256), "inside this connection's"),
           (Scatter("t", 3, 512, [rows([2, 2])]), "repeated"),
           (Scatter("t", 4, 256, [rows([-1])]), "negative"),
           (Scatter("t", 5, 256, [rows([2], stride=100)]), "malformed"),
           (Scatter("t", 6, 0, []), "does not match")]
    for msg, why in bad:
        with pytest.raises(StagingError, match=why):
            await reader.scatter(msg, area, allowed)
    assert not cache.any(), "a refused chunk wrote into the cache"
    await reader.scatter(Scatter("t", 7, 512, [rows([5, 2])], slot_offset=4096), area, allowed)
    assert (cache[0, [2, 5]] == 7).all() and not cache[1].any() and not cache[0, [0, 1, 3, 4, 6, 7]].any()
