"""Staging: the range copies (connector.transport.device_copy; both the CPU memmove path and the indexed path the
GPU uses, run here on CPU memory) and the pure half (connector.core.staging_ranges): chunking, the slot allocator,
and the receiver's destination check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from connector.core.errors import StagingError
from connector.core.layout import Region
from connector.core.staging_ranges import Slots, allowed_ranges, check_destinations, chunks, split_long
from connector.transport.device_copy import copy_ranges, indexed_copy


@pytest.mark.parametrize("copy", [copy_ranges, indexed_copy], ids=["memmove", "indexed"])
@pytest.mark.parametrize("unit", [1, 2, 8])
def test_copy_ranges_gathers_and_scatters_byte_exact(copy, unit):
    rng = np.random.default_rng(unit)
    src = torch.from_numpy(rng.integers(0, 256, 1 << 16, dtype=np.uint8))
    dst = torch.zeros(1 << 16, dtype=torch.uint8)
    n = 300
    starts = np.sort(rng.choice((1 << 16) // 64, n, replace=False)) * 64
    lens = rng.integers(1, 8, n) * unit
    order = rng.permutation(n)  # gather in a scrambled order: destinations packed one after another
    packed = np.cumsum(lens[order]) - lens[order]
    copy(src.data_ptr() + starts[order], dst.data_ptr() + packed, lens[order], torch.device("cpu"))
    for k, i in enumerate(order):
        a, m = packed[k], lens[i]
        assert torch.equal(dst[a:a + m], src[starts[i]:starts[i] + m])
    assert int(dst[int(lens.sum()):].count_nonzero()) == 0  # nothing written past the packed bytes
    back = torch.zeros_like(src)  # scatter the packed bytes back to where they came from
    copy(dst.data_ptr() + packed, back.data_ptr() + starts[order], lens[order], torch.device("cpu"))
    mask = torch.zeros(1 << 16, dtype=torch.bool)
    for s, m in zip(starts, lens):
        mask[s:s + m] = True
    assert torch.equal(back[mask], src[mask]) and int(back[~mask].count_nonzero()) == 0


def test_chunks_and_split_long():
    assert chunks(np.array([10, 10, 10, 25, 5]), 25) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert chunks(np.array([5, 5]), 100) == [(0, 2)]
    with pytest.raises(ValueError, match="more than a staging chunk"):
        chunks(np.array([30]), 25)
    local, remote = split_long(np.array([[1000, 70, 0], [5, 20, 0]]), np.array([[9000, 70, 1], [7, 20, 1]]), 30)
    assert local.tolist() == [[1000, 30, 0], [1030, 30, 0], [1060, 10, 0], [5, 20, 0]]
    assert remote.tolist() == [[9000, 30, 1], [9030, 30, 1], [9060, 10, 1], [7, 20, 1]]


def test_slots():
    slots = Slots(100, 30)
    taken = [slots.take() for _ in range(4)]
    assert taken == [0, 30, 60, None]  # 100 B hold three 30-B slots
    slots.give_back(30)
    assert slots.take() == 30
    with pytest.raises(ValueError):
        slots.give_back(31)
    assert Slots(0, 0).take() is None


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
    # a run of registered blocks adjacent in memory is one range: a coalesced descriptor may cross block bounds
    run = allowed_ranges([idx], [[3, 4, 5, 7]])
    check_destinations(np.array([0x90000 + 3 * 64]), np.array([3 * 64]), run)
    with pytest.raises(StagingError):
        check_destinations(np.array([0x90000 + 5 * 64]), np.array([2 * 64]), run)  # block 6 is not registered
    with pytest.raises(StagingError, match="no blocks"):
        check_destinations(np.array([0x10000]), np.array([8]), allowed_ranges([kv], [[]]))
