"""`kv_checksum`: end-to-end integrity per (pool, layer, block). The digests and the rows each side digests (pure,
over real memory in this process), then transfers over real NIXL between processes with decode verifying, and a
transfer whose bytes changed after they landed failing with the pool, layer and block named."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from connector.core.checksums import destination_rows, mismatch, source_rows, transfer_spans
from connector.core.descriptors import batch_descriptors
from connector.core.errors import TransferFailed
from connector.core.hf_config import load_model
from connector.core.layout import blocks_for
from connector.core.plan import build_plan
from connector.core.staging_ranges import Rows
from connector.engine.config import ReceiverConfig, SideChannelConfig
from connector.engine.receiver import RecvSpec
from connector.protocol.addressing import PrefillAddress
from sparse_kv_lab.sim.buffers import RankBuffers, pick_blocks
from sparse_kv_lab.sim.cluster import run_scenario
from connector.transport.device_copy import BlockCopier
from tests.helpers import scenario, side
from tests.test_stream_faults import BLOCK, TOKENS, make_scenario, start_prefill

CPU = BlockCopier("cpu")


def rows_of(buf: np.ndarray, row_bytes: int, stride: int, blocks: list[int], offset: int = 0) -> Rows:
    return Rows(buf.ctypes.data + offset, stride, row_bytes, np.asarray(blocks, dtype=np.int64))


def test_a_digest_follows_the_bytes_not_their_address_or_word_alignment():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, 8 * 4096 + 8, dtype=np.uint8)
    b = np.zeros_like(a)
    b[4:4 + 8 * 4096] = a[:8 * 4096]  # the same blocks, 4 bytes further on (rows only 4-aligned there)
    mine = CPU.digests([rows_of(a, 4096, 4096, [0, 3, 5])])
    assert mine.dtype == np.uint64 and mine.shape == (3,)
    assert np.array_equal(mine, CPU.digests([rows_of(b, 4096, 4096, [0, 3, 5], offset=4)]))
    assert len(set(mine.tolist())) == 3  # different blocks, different digests
    a[3 * 4096 + 1000] ^= 1  # one bit of block 3
    after = CPU.digests([rows_of(a, 4096, 4096, [0, 3, 5])])
    assert after[0] == mine[0] and after[2] == mine[2] and after[1] != mine[1]


def test_two_words_swapped_and_the_parts_swapped_change_the_digest():
    words = np.arange(2048, dtype=np.int32)
    swapped = words.copy()
    swapped[[10, 11]] = swapped[[11, 10]]
    base = CPU.digests([rows_of(words.view(np.uint8), 8192, 8192, [0])])
    assert CPU.digests([rows_of(swapped.view(np.uint8), 8192, 8192, [0])]) != base
    k, v = np.arange(1024, dtype=np.int32), np.arange(1024, 2048, dtype=np.int32)
    kv = CPU.digests([rows_of(k.view(np.uint8), 4096, 4096, [0]), rows_of(v.view(np.uint8), 4096, 4096, [0])])
    vk = CPU.digests([rows_of(v.view(np.uint8), 4096, 4096, [0]), rows_of(k.view(np.uint8), 4096, 4096, [0])])
    assert kv == base and vk != kv  # parts digest as one row, in order: K then V is the concatenation


def copy(descs) -> None:
    for (src, n), (dst, _) in zip(*descs.pairs()):
        ctypes.memmove(dst, src, n)


@pytest.mark.parametrize("model_name,prefill,decode", [
    ("qwen3-8b", "tp=2,pp=1", "tp=1,pp=1"),       # each decode block is filled by two prefill ranks' head slices
    ("minimax-m3", "tp=1,pp=2", "tp=1,pp=1"),     # main KV and index K from two stages
])
def test_each_prefill_rank_digests_exactly_its_share_of_decode_blocks(model_name, prefill, decode):
    model = load_model(model_name)
    pre, dec = side(model, prefill), side(model, decode)
    plan = build_plan(model, pre, dec)
    tokens, nblocks = 40, 16
    src_blocks = pick_blocks(tokens, BLOCK, nblocks, seed=1)
    dst_blocks = pick_blocks(tokens, BLOCK, nblocks, seed=2)
    dst = RankBuffers(model, dec, (0, 0), BLOCK, nblocks)
    dst_regions = {r.key: r for r in dst.regions()}
    srcs = {}
    for rank in [(pp, tp) for pp in range(pre.pp) for tp in range(pre.tp)]:
        buf = RankBuffers(model, pre, rank, BLOCK, nblocks)
        for layer in buf.layout.layers("kv") + buf.layout.layers("index_k"):
            buf.fill(layer, src_blocks, 0, tokens)
        routes = plan.layer_routes(rank, (0, 0))
        regions = {r.key: r for r in buf.regions()}
        every_block = [(layer, 0, blocks_for(tokens, BLOCK)) for layer in routes]  # what the WRITEs move
        copy(batch_descriptors(regions, dst_regions, routes, every_block, src_blocks, dst_blocks))
        spans = transfer_spans(routes, 0, tokens, BLOCK)  # what the checksums cover
        sent = source_rows(regions, dst_regions, routes, spans, src_blocks, dst_blocks)
        srcs[rank] = (buf, routes, spans, {r.key: CPU.digests(r.parts).tobytes() for r in sent})
    assert not dst.verify(dst_blocks, 0, tokens)  # the copy itself is right
    for rank, (_buf, routes, spans, digests) in srcs.items():
        rows = destination_rows(dst_regions, routes, spans, dst_blocks)
        assert {r.key for r in rows} == set(digests)
        assert mismatch(rank, rows, [CPU.digests(r.parts) for r in rows], digests) == ""
    # One byte of one decode block changes: the rank that wrote that byte names the pool, layer and block.
    victim = dst_blocks[0][1]  # (block 2, tokens 32-39 of 40, is partly filled: not covered)
    region = dst_regions[("kv", 1)]
    ctypes.c_uint8.from_address(region.base_addr + victim * region.block_stride).value ^= 0xFF
    found = []
    for rank, (_buf, routes, spans, digests) in srcs.items():
        rows = destination_rows(dst_regions, routes, spans, dst_blocks)
        found.append(mismatch(rank, rows, [CPU.digests(r.parts) for r in rows], digests))
    assert sum(bool(f) for f in found) == 1, found  # the byte lies in one rank's head slice
    assert f"kv layer 1 heads 0-" in "".join(found) and f"decode blocks [{victim}]" in "".join(found)


def test_the_last_partly_filled_block_is_not_covered():
    routes = {0: ["r"], 3: ["r"]}
    # (layer, first block, end block, final: per-request states are covered whole)
    assert transfer_spans(routes, 0, 40, 16) == [(0, 0, 2, True), (3, 0, 2, True)]  # blocks 0-1 full, 2 partly
    assert transfer_spans(routes, 16, 48, 16) == [(0, 1, 3, True), (3, 1, 3, True)]  # a prefix hit of one block
    assert transfer_spans(routes, 0, 10, 16) == [(0, 0, 0, True), (3, 0, 0, True)]  # no paged block full
    # caches with blocks of 16 and 64 tokens (unit 16): only what ends a 64-token block is full in both
    assert transfer_spans(routes, 0, 100, 16, 64) == [(0, 0, 4, True), (3, 0, 4, True)]


def test_a_missing_checksum_is_a_mismatch_not_a_pass():
    rows = destination_rows({}, {}, [], [[]])
    assert mismatch((0, 0), rows, [], {}) == ""  # nothing routed, nothing owed
    model = load_model("qwen3-8b")
    dst = RankBuffers(model, side(model, "tp=1,pp=1"), (0, 0), BLOCK, 8)
    regions = {r.key: r for r in dst.regions()}
    plan = build_plan(model, side(model, "tp=1,pp=1"), side(model, "tp=1,pp=1"))
    routes = plan.layer_routes((0, 0), (0, 0))
    blocks = pick_blocks(20, BLOCK, 8, seed=3)
    rows = destination_rows(regions, routes, transfer_spans(routes, 0, 20, BLOCK), blocks)
    problem = mismatch((0, 1), rows, [CPU.digests(r.parts) for r in rows], {})
    assert "prefill rank (0, 1)" in problem and "prefill sent no checksum" in problem


# ---- real NIXL between processes ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("staging_mb", [0, 8], ids=["direct", "staged"])
def test_transfers_verify_end_to_end_in_every_layout(m3_index_v, staging_mb):
    """Decode (kv_checksum) digests every (route, block) it received and compares with each prefill rank's: head
    slices (dense TP2 -> TP1), stages (PP2 -> PP1, index K and V), a decode prefix hit and a two-chunk prefill."""
    on = {"kv_checksum": True, "staging_mb": staging_mb}
    cases = [
        scenario(load_model("qwen3-8b"), "tp=2,pp=1", "tp=1,pp=1", tokens=48, **on),
        scenario(m3_index_v, "tp=1,pp=2", "tp=1,pp=1", tokens=100, chunks=2, **on),
        scenario(m3_index_v, "tp=1,pp=1", "tp=1,pp=2", tokens=77, prefix_tokens=32, **on),
    ]
    for sc in cases:
        result = run_scenario(sc)
        assert result.verified, result.problems
        assert result.checksummed_blocks > 0


def test_bytes_changed_after_landing_fail_the_transfer_naming_the_block(prefill_cluster_and_decode_checked):
    """Prefill ranks in their own processes WRITE over real NIXL; decode's blocks are changed after the last WRITE
    landed and before decode verifies (as a block reused too early would be): the transfer fails, naming the pool,
    layer and decode block, where without kv_checksum it would have been reported complete."""
    sc, cluster, decode, receiver = prefill_cluster_and_decode_checked
    start_prefill(cluster, "t-sum")
    blocks = pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=11)
    region = decode.me().by_key[("index_k", 3)]
    victim = blocks[region.group][1]
    verify = receiver._verify

    def corrupt_then_verify(*args):
        ctypes.c_uint8.from_address(region.base_addr + victim * region.block_stride + 5).value ^= 0x40
        return verify(*args)

    receiver._verify = corrupt_then_verify
    addr = PrefillAddress("127.0.0.1", cluster.base_port)
    with pytest.raises(TransferFailed, match=rf"index_k layer 3 heads 0-0: decode blocks \[{victim}\] \(1 of"):
        decode.loop.run(receiver.receive(RecvSpec("t-sum", str(addr), blocks, 0, TOKENS)), 30)
    receiver._verify = verify
    start_prefill(cluster, "t-sum-2")  # the next transfer, untouched, verifies
    result = decode.loop.run(receiver.receive(RecvSpec("t-sum-2", str(addr), blocks, 0, TOKENS)), 30)
    assert result.checksummed_blocks > 0 and not decode.bufs.verify(blocks, 0, TOKENS)


@pytest.fixture
def prefill_cluster_and_decode_checked(m3, cluster, open_rank):
    sc = make_scenario(m3, "tp=1,pp=2")
    prefills = cluster(sc, spawn=("prefill",))
    decode = open_rank(sc.rank_spec("decode", (0, 0), run_id="test"))
    receiver = decode.receiver(ReceiverConfig(SideChannelConfig(dead_after_s=3.0), transfer_timeout_s=20.0,
                                              kv_checksum=True))
    return sc, prefills, decode, receiver
