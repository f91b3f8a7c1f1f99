"""A lost connection to any one rank of a prefill engine fails every transfer waiting on that engine, on every
decode rank, whatever the TP/PP shapes and whichever connection goes first. Real NIXL between real processes on
loopback (the same on two nodes with a cut link: tests/test_two_nodes.py)."""

from __future__ import annotations

import time

import pytest

from connector.core.errors import TransferFailed
from connector.engine.config import ReceiverConfig, SideChannelConfig
from connector.engine.receiver import RecvSpec
from sparse_kv_lab.sim.buffers import pick_blocks
from tests.helpers import scenario

pytestmark = pytest.mark.slow
TOKENS, BLOCK = 64, 16


def test_losing_a_prefill_rank_that_owes_this_decode_rank_nothing_fails_its_transfer_at_once(m3, cluster, open_rank):
    """TP2 -> TP2: decode rank (0, 1) gets every byte from prefill rank (0, 1); rank (0, 0) owes it nothing and
    completes at once. When (0, 0)'s connection is the one that goes (its process is killed), the transfer must
    fail then, naming the lost rank, not wait out the transfer timeout: decode drops the whole engine, closing the
    connection to (0, 1) too, whose own reader can then no longer fail it. Decode still asks (0, 1), over a new
    connection, to confirm it writes nothing more before the blocks go back."""
    sc = scenario(m3, "tp=2,pp=1", "tp=2,pp=1", tokens=TOKENS, block_size=BLOCK, timeout_s=60.0)
    prefills = cluster(sc, spawn=("prefill",))
    decode = open_rank(sc.rank_spec("decode", (0, 1), run_id="test-lost"))
    assert decode.me().hello("decode", decode.transport) and sc.prefill.tp == 2
    timeout_s = 40.0
    receiver = decode.receiver(ReceiverConfig(SideChannelConfig(dead_after_s=30.0), transfer_timeout_s=timeout_s,
                                              stop_timeout_s=20.0))
    tid = "t-lost-00"
    blocks = pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=1)
    for rank, (_p, conn) in prefills.prefill.items():
        prefills.ask(conn, ("start", tid, TOKENS, 0), 30, rank)
    got = decode.loop.submit(receiver.receive(RecvSpec(tid, f"127.0.0.1:{prefills.base_port}", blocks, 0, TOKENS)))
    deadline = time.monotonic() + 20
    while not receiver.busy["pending"]:
        assert time.monotonic() < deadline, "the receive never started"
        time.sleep(0.02)
    time.sleep(0.5)  # registered with both ranks
    (_p0, conn0), (_p1, conn1) = prefills.prefill[(0, 0)], prefills.prefill[(0, 1)]
    conn0.send(("chunk", tid, 0, TOKENS, 0.0, "stream", "all"))
    prefills.reply(conn0, 30, "prefill (0, 0)")  # computed: it owes decode (0, 1) nothing, so it completed
    conn1.send(("chunk", tid, 0, TOKENS, 200.0, "stream", "all"))  # 60 layers x 200 ms: still sending
    time.sleep(1.0)
    assert not got.done()
    prefills.prefill[(0, 0)][0].kill()
    killed = time.monotonic()
    with pytest.raises(TransferFailed) as failed:
        got.result(timeout_s + 10)
    took = time.monotonic() - killed
    print(f"\nprefill rank (0, 0) killed: decode rank (0, 1) failed the transfer after {took:.2f} s: {failed.value}")
    assert "(0, 0)" in str(failed.value) and "went away" in str(failed.value), failed.value
    assert took < 10, f"waited {took:.1f} s: the transfer waited out its timeout instead of failing at once"
    assert receiver.busy == {"pending": 0, "confirming": 0}
