"""Bad input and dead peers against the real engine: one side is a worker process, the other runs in the test
process, both on real NIXL. Each case must fail clearly, write nothing, and leave no state behind."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest
import torch

from connector.core.errors import ControlError, TransferFailed
from connector.engine.config import ReceiverConfig, SenderConfig, SideChannelConfig
from connector.engine.receiver import RecvSpec
from connector.protocol.addressing import PrefillAddress
from connector.protocol.messages import Register, RegisterError
from sparse_kv_lab.sim.buffers import pick_blocks
from sparse_kv_lab.sim.cluster import Cluster, Scenario
from sparse_kv_lab.sim.env import apply_env
from sparse_kv_lab.sim.rank import SimRank
from connector.transport.client import connect
from tests.helpers import bare_side_channel, scenario

pytestmark = pytest.mark.slow
TOKENS, BLOCK = 64, 16


def make_scenario(model, prefill="tp=1,pp=1", **kw) -> Scenario:
    kw.setdefault("layer_ms", 0.0)
    return scenario(model, prefill, tokens=TOKENS, block_size=BLOCK, timeout_s=30.0, **kw)


@pytest.fixture
def prefill_cluster_and_decode(m3, cluster, open_rank):
    """`make(prefill, layer_ms)`: prefill ranks as worker processes, and decode (0, 0) in this process."""

    def make(prefill="tp=1,pp=1", layer_ms=0.0, staging_mb=0):
        sc = make_scenario(m3, prefill, layer_ms=layer_ms, staging_mb=staging_mb)
        prefills = cluster(sc, spawn=("prefill",))
        decode = open_rank(sc.rank_spec("decode", (0, 0), run_id="test"))
        receiver = decode.receiver(ReceiverConfig(SideChannelConfig(dead_after_s=3.0), transfer_timeout_s=20.0))
        return sc, prefills, decode, receiver

    return make


@contextlib.contextmanager
def sender_and_receiver(model, tag: str, *, lease_s: float = 120.0, staging_mb: int = 0):
    """A started StreamSender and a StreamReceiver, each on its own SimRank in this process (TP1/PP1), with staging
    buffers of `staging_mb` (one slot each). Yields (prefill, sender, port, decode, receiver); closes both ranks."""
    apply_env()  # before the ranks' NIXL agents load (as the open_rank fixture does)
    sc = make_scenario(model, staging_mb=staging_mb)
    with SimRank(sc.rank_spec("prefill", (0, 0), run_id=f"test-{tag}")) as prefill, \
            SimRank(sc.rank_spec("decode", (0, 0), run_id=f"test-{tag}")) as decode:
        sender = prefill.sender(SenderConfig(port=0, lease_s=lease_s))
        yield prefill, sender, sender.port, decode, decode.receiver()


def start_prefill(cluster: Cluster, tid: str, layer_ms: float = 0.0, wait: bool = True) -> None:
    for rank, (_p, conn) in cluster.prefill.items():
        cluster.ask(conn, ("start", tid, TOKENS, 0), 30, rank)
    for rank, (_p, conn) in cluster.prefill.items():
        conn.send(("chunk", tid, 0, TOKENS, layer_ms, "stream", "all"))
    if wait:
        for rank, (_p, conn) in cluster.prefill.items():
            cluster.reply(conn, 60, rank)


def test_out_of_range_block_ids_are_refused_and_nothing_is_written(prefill_cluster_and_decode):
    sc, cluster, decode, receiver = prefill_cluster_and_decode()
    start_prefill(cluster, "t-bad-blocks")
    blocks = pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=1)
    blocks[0][2] = decode.spec.num_blocks + 5
    addr = PrefillAddress("127.0.0.1", cluster.base_port)
    with pytest.raises(TransferFailed, match=rf"block ids \[{decode.spec.num_blocks + 5}\] are outside kv layer 0"):
        decode.loop.run(receiver.receive(RecvSpec("t-bad-blocks", str(addr), blocks, 0, TOKENS)), 30)
    time.sleep(0.3)
    assert not any(bool(t.any()) for t in decode.bufs.tensors), "bytes were written for a refused registration"


def test_unknown_transfer_id_and_foreign_layer_are_refused(prefill_cluster_and_decode):
    sc, cluster, decode, receiver = prefill_cluster_and_decode("tp=1,pp=2")
    start_prefill(cluster, "t-layers")

    async def register(port: int, **fields) -> object:
        conn = await connect("127.0.0.1", port, receiver.hello, bare_side_channel(), timeout=10)
        try:
            reg = dict(transfer_id="t-layers", dst_pp=0, dst_tp=0,
                       block_ids=pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=2), first_token=0,
                       num_tokens=TOKENS, layers=[])
            reg.update(fields)
            await conn.send(Register(**reg))
            return await conn.recv(timeout=10)
        finally:
            await conn.aclose()

    # stage 0 holds layers 0-29: asking it for layer 59 is refused, naming the layer
    reply = decode.loop.run(register(cluster.base_port, layers=[3, 59]), 30)
    assert isinstance(reply, RegisterError) and "layers [59]" in reply.reason and "layer split" in reply.reason
    reply = decode.loop.run(register(cluster.base_port, num_tokens=TOKENS + 1), 30)
    assert isinstance(reply, RegisterError) and "prompt tokens" in reply.reason
    assert not any(bool(t.any()) for t in decode.bufs.tensors)


def test_incompatible_fingerprint_and_garbage_frames_leave_the_server_serving(prefill_cluster_and_decode):
    import msgspec

    sc, cluster, decode, receiver = prefill_cluster_and_decode()
    bad = msgspec.structs.replace(receiver.hello, fingerprint="0" * 16)
    with pytest.raises(ControlError, match="different KV caches: model fingerprints .* and 0000000000000000"):
        decode.loop.run(connect("127.0.0.1", cluster.base_port, bad, bare_side_channel(), timeout=10), 30)
    for garbage in (b"\x00\x00\x00\x05\x00\x01hello", b"GET / HTTP/1.1\r\n\r\n", b"\xff" * 64):
        with socket.create_connection(("127.0.0.1", cluster.base_port), timeout=10) as s:
            s.sendall(garbage)
            s.settimeout(10)
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass  # closed on us: what we want
    # still serving: a full transfer now works
    start_prefill(cluster, "t-after-garbage")
    blocks = pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=3)
    res = decode.loop.run(receiver.receive(RecvSpec("t-after-garbage", f"127.0.0.1:{cluster.base_port}", blocks, 0,
                                                    TOKENS)), 30)
    assert res.bytes_written > 0
    assert decode.bufs.verify(blocks, 0, TOKENS) == []


def test_prefill_killed_mid_transfer_fails_the_receiver_within_its_timeout(prefill_cluster_and_decode):
    sc, cluster, decode, receiver = prefill_cluster_and_decode(layer_ms=100.0)
    blocks = pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=4)
    fut = decode.loop.submit(receiver.receive(RecvSpec("t-kill-p", f"127.0.0.1:{cluster.base_port}", blocks, 0,
                                                       TOKENS)))
    start_prefill(cluster, "t-kill-p", layer_ms=100.0, wait=False)  # 60 layers x 100 ms
    time.sleep(1.5)
    assert not fut.done()
    proc, _conn = cluster.prefill[(0, 0)]
    proc.kill()
    began = time.monotonic()
    with pytest.raises(TransferFailed, match="went away"):
        fut.result(15)
    assert time.monotonic() - began < 10


def test_decode_killed_mid_transfer_frees_the_sender_state(m3, cluster, open_rank):
    sc = make_scenario(m3)
    decodes = cluster(sc, spawn=("decode",))
    prefill = open_rank(sc.rank_spec("prefill", (0, 0), base_port=decodes.base_port, run_id="test"))
    sender = prefill.sender(SenderConfig(port=decodes.base_port, lease_s=30))
    tid = "t-kill-d"
    blocks = pick_blocks(TOKENS, BLOCK, prefill.spec.num_blocks, seed=5)
    sender.start_request(tid, TOKENS)
    sender.begin_chunk(tid, blocks, TOKENS)
    _, conn = decodes.decode[(0, 0)]
    decodes.ask(conn, ("receive", tid, TOKENS, 0, f"127.0.0.1:{decodes.base_port}", 0), 30, "decode")
    deadline = time.monotonic() + 10
    while not sender.requests.get(tid) or not sender.requests[tid].dests:
        assert time.monotonic() < deadline, "decode never registered"
        time.sleep(0.05)
    for layer in range(20):
        prefill.bufs.fill(layer, blocks, 0, TOKENS)
        sender.layer_ready(tid, layer)
    proc, _ = decodes.decode[(0, 0)]
    proc.kill()
    for layer in range(20, 60):
        prefill.bufs.fill(layer, blocks, 0, TOKENS)
    sender.end_chunk(tid)
    began = time.monotonic()
    ok = prefill.loop.run(sender.wait_finished(tid, 20), 25)
    assert ok is False
    assert time.monotonic() - began < 15
    assert tid not in sender.requests and not sender.ownership.parked
    assert prefill.transport.inflight_bytes == 0


@pytest.mark.parametrize("staging_mb", [0, 4], ids=["direct", "staged"])
def test_decode_abort_waits_until_prefill_stopped_writing(prefill_cluster_and_decode, staging_mb):
    """Staged: chunks still in flight when decode aborts are dropped by decode, not scattered."""
    sc, cluster, decode, receiver = prefill_cluster_and_decode(layer_ms=60.0, staging_mb=staging_mb)
    blocks = pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=6)
    fut = decode.loop.submit(receiver.receive(RecvSpec("t-abort-d", f"127.0.0.1:{cluster.base_port}", blocks, 0,
                                                       TOKENS)))
    start_prefill(cluster, "t-abort-d", layer_ms=60.0, wait=False)  # 60 layers x 60 ms
    time.sleep(1.5)
    assert not fut.done()
    decode.loop.run(receiver.abort("t-abort-d", "client went away"), 10)
    with pytest.raises(TransferFailed, match="aborted: client went away"):
        fut.result(20)
    # prefill confirmed it stopped: whatever it computes from now on never lands here
    written = [t.clone() for t in decode.bufs.tensors]
    assert any(bool(t.any()) for t in written), "some layers should have streamed before the abort"
    _, conn = cluster.prefill[(0, 0)]
    cluster.reply(conn, 30, "prefill")  # let prefill finish computing every layer
    time.sleep(0.5)
    assert all(torch.equal(a, b) for a, b in zip(written, decode.bufs.tensors)), "bytes landed after Stopped"
    ok = cluster.ask(conn, ("finish", "t-abort-d"), 30, "prefill")
    assert ok[1] is False  # the prefill side released the request as not completed


def test_lease_frees_a_finished_request_that_decode_never_registers(m3, open_rank):
    prefill = open_rank(make_scenario(m3).rank_spec("prefill", (0, 0), run_id="test"))
    sender = prefill.sender(SenderConfig(port=0, lease_s=1.0))
    finished = []
    sender.on_finished = lambda tid, ok: finished.append((tid, ok))
    blocks = pick_blocks(TOKENS, BLOCK, prefill.spec.num_blocks, seed=7)
    sender.start_request("t-lease", TOKENS)
    sender.begin_chunk("t-lease", blocks, TOKENS)
    sender.end_chunk("t-lease")  # prefill done; no decode ever registers
    began = time.monotonic()
    assert prefill.loop.run(sender.wait_finished("t-lease", 10), 15) is False
    assert 0.9 < time.monotonic() - began < 5
    assert finished == [("t-lease", False)] and "t-lease" not in sender.requests


def test_decode_abort_before_registering_frees_prefill_without_waiting_for_the_lease(prefill_cluster_and_decode):
    sc, cluster, decode, receiver = prefill_cluster_and_decode()
    start_prefill(cluster, "t-abort-early")  # prefill computed everything; its lease is 120 s
    decode.loop.run(receiver.abort_unregistered("t-abort-early", PrefillAddress("127.0.0.1", cluster.base_port),
                                                "client went away"), 20)
    began = time.monotonic()
    _, conn = cluster.prefill[(0, 0)]
    ok = cluster.ask(conn, ("finish", "t-abort-early"), 30, "prefill")
    assert ok[1] is False and time.monotonic() - began < 5
    assert not any(bool(t.any()) for t in decode.bufs.tensors)


@pytest.mark.parametrize("staging_mb", [0, 4], ids=["direct", "staged"])
def test_prefill_restart_after_preemption_resends_from_the_new_blocks(prefill_cluster_and_decode, open_rank,
                                                                       staging_mb):
    """vLLM may preempt a prefill and recompute it into other blocks: what was streamed from the old blocks must
    not count, and decode must end up with the bytes of the recomputation."""
    sc, cluster, decode, receiver = prefill_cluster_and_decode(staging_mb=staging_mb)
    prefill = open_rank(sc.rank_spec("prefill", (0, 0), run_id="test-2"))
    sender = prefill.sender(SenderConfig(port=cluster.base_port + 1))
    addr = PrefillAddress("127.0.0.1", cluster.base_port + 1)
    dst = pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=8)
    fut = decode.loop.submit(receiver.receive(RecvSpec("t-preempt", str(addr), dst, 0, TOKENS)))
    old = pick_blocks(TOKENS, BLOCK, prefill.spec.num_blocks, seed=9)
    sender.start_request("t-preempt", TOKENS)
    sender.begin_chunk("t-preempt", old, 32)
    for layer in range(60):  # the first chunk is computed...
        prefill.bufs.fill(layer, old, 0, 32)
    for t in prefill.bufs.tensors:
        t.zero_()  # ...but preempted, its blocks reused by another request before the WRITEs read them
    for layer in range(60):
        sender.layer_ready("t-preempt", layer)
    sender.end_chunk("t-preempt")
    time.sleep(0.5)
    new = pick_blocks(TOKENS, BLOCK, prefill.spec.num_blocks, seed=10)
    sender.begin_chunk("t-preempt", new, TOKENS)  # recomputed from scratch into new blocks, in one go
    for layer in range(60):
        prefill.bufs.fill(layer, new, 0, TOKENS)
    sender.end_chunk("t-preempt")
    fut.result(30)
    assert decode.bufs.verify(dst, 0, TOKENS) == []
    assert (sender.stats.staged_chunks > 0) == bool(staging_mb)


def test_decode_heartbeats_extend_the_lease(m3):
    """A finished request whose WRITEs to a registered decode rank take three leases (1 s each) survives them,
    because that decode rank's connection keeps listing it in heartbeats; then it completes byte-exact. (Only the
    registering connection's heartbeats count: tests/test_security.py.)"""
    sc = make_scenario(m3)
    with SimRank(sc.rank_spec("prefill", (0, 0), run_id="test-hb")) as prefill, \
            SimRank(sc.rank_spec("decode", (0, 0), run_id="test-hb")) as decode:
        sender = prefill.sender(SenderConfig(port=0, lease_s=1.0))
        receiver = decode.receiver(ReceiverConfig(SideChannelConfig(heartbeat_interval_s=0.2), transfer_timeout_s=30))
        real_write = sender.transport.write

        async def slow_write(*args, **kwargs):
            await asyncio.sleep(3.0)  # e.g. a slow link: the WRITEs outlast the lease
            return await real_write(*args, **kwargs)

        sender.transport.write = slow_write
        blocks = pick_blocks(TOKENS, BLOCK, prefill.spec.num_blocks, seed=11)
        sender.start_request("t-hb", TOKENS)
        sender.begin_chunk("t-hb", blocks, TOKENS)
        for layer in range(60):
            prefill.bufs.fill(layer, blocks, 0, TOKENS)
        sender.end_chunk("t-hb")  # finished; the lease (1 s) starts now
        dst = pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=12)
        began = time.monotonic()
        decode.loop.run(receiver.receive(RecvSpec("t-hb", f"127.0.0.1:{sender.port}", dst, 0, TOKENS)), 30)
        assert time.monotonic() - began > 2.5  # the WRITEs did outlast the 1 s lease
        assert prefill.loop.run(sender.wait_finished("t-hb", 10), 15) is True
        assert decode.bufs.verify(dst, 0, TOKENS) == []


def test_sender_counts_bytes_streamed_during_compute_apart_from_the_sweep(m3):
    """SenderStats (the source of the vLLM metrics): a layer written while its request still computes counts as
    streamed; what the final sweep sends does not; a completed transfer counts as ok."""
    def wait_for(check, what: str) -> None:
        deadline = time.monotonic() + 15
        while not check():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    with sender_and_receiver(m3, "st") as (prefill, sender, port, decode, receiver):
        blocks = pick_blocks(TOKENS, BLOCK, prefill.spec.num_blocks, seed=21)
        dst = pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=22)
        sender.start_request("t-st", TOKENS)
        sender.begin_chunk("t-st", blocks, TOKENS)
        got = decode.loop.submit(receiver.receive(RecvSpec("t-st", f"127.0.0.1:{port}", dst, 0, TOKENS)))
        # (start_request is only queued for the loop: the request may not exist yet)
        wait_for(lambda: "t-st" in sender.requests and sender.requests["t-st"].dests, "decode never registered")
        prefill.bufs.fill(0, blocks, 0, TOKENS)
        sender.layer_ready("t-st", 0)  # layer 0 computed; 59 to go
        wait_for(lambda: sender.stats.writes >= 1, "layer 0 was not streamed")
        streamed = sender.stats.bytes_sent_during_compute
        assert streamed == sender.stats.bytes_sent > 0
        for layer in range(1, 60):
            prefill.bufs.fill(layer, blocks, 0, TOKENS)
        sender.end_chunk("t-st")  # the sweep: layers 1-59
        got.result(30)
        assert prefill.loop.run(sender.wait_finished("t-st", 10), 15) is True
        assert decode.bufs.verify(dst, 0, TOKENS) == []
        stats = sender.stats
        assert stats.bytes_sent_during_compute == streamed < stats.bytes_sent
        assert (stats.sends_ok, stats.sends_failed) == (1, 0)
        # every NIXL WRITE was timed: posting it, and from the post to its completion
        assert len(stats.transfer_seconds) == len(stats.post_seconds) == stats.writes
        assert all(0 < p <= t for p, t in zip(stats.post_seconds, stats.transfer_seconds))


def test_decode_refuses_a_staged_chunk_aimed_outside_its_blocks(m3, monkeypatch):
    """Staging lets prefill name decode-side addresses in a side-channel message, so decode checks them: a chunk
    whose rows are not inside the blocks registered for the transfer is refused, nothing is written, and the
    transfer fails on both sides with the reason."""
    import msgspec
    import numpy as np

    from connector.protocol.messages import Scatter
    from connector.transport.connection import ControlConnection

    with sender_and_receiver(m3, "evil", staging_mb=1) as (prefill, sender, port, decode, receiver):
        dst = pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=32)
        outside = [b for b in range(decode.spec.num_blocks) if b not in dst[0] and b not in dst[1]]
        real_send = ControlConnection.send

        async def aimed_elsewhere(conn, msg):
            if isinstance(msg, Scatter):  # every row to a block decode did not register
                msg = msgspec.structs.replace(msg, rows=[msgspec.structs.replace(
                    r, blocks=np.array(outside[:len(r.blocks) // 8], dtype="<i8").tobytes()) for r in msg.rows])
            return await real_send(conn, msg)

        monkeypatch.setattr(ControlConnection, "send", aimed_elsewhere)
        blocks = pick_blocks(TOKENS, BLOCK, prefill.spec.num_blocks, seed=31)
        for layer in range(60):
            prefill.bufs.fill(layer, blocks, 0, TOKENS)
        sender.start_request("t-evil", TOKENS)
        sender.begin_chunk("t-evil", blocks, TOKENS)
        sender.end_chunk("t-evil")
        with pytest.raises(TransferFailed, match="refused staged chunk .* outside the blocks registered"):
            decode.loop.run(receiver.receive(RecvSpec("t-evil", f"127.0.0.1:{port}", dst, 0, TOKENS)), 30)
        assert prefill.loop.run(sender.wait_finished("t-evil", 10), 15) is False
        assert sender.stats.staged_chunks > 0
        assert not any(bool(t.any()) for t in decode.bufs.tensors), "a refused chunk wrote into decode's cache"


def test_registration_after_prefill_for_an_unknown_transfer_is_refused_at_once(m3):
    # Sequential flow: decode learned the transfer from prefill's response, so a prefill that does not know it
    # (restarted since, or the router changed the params) must refuse now, not park it for a lease.
    with sender_and_receiver(m3, "after-prefill") as (prefill, sender, port, decode, receiver):
        blocks = pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=7)
        started = time.monotonic()
        with pytest.raises(TransferFailed, match="restarted since"):
            decode.run(receiver.receive(RecvSpec("t-gone", f"127.0.0.1:{port}", blocks, 0, TOKENS,
                                                 prefill_finished=True)), 30)
        assert time.monotonic() - started < 5
        assert "t-gone" not in sender.ownership.parked
        assert not any(bool(t.any()) for t in decode.bufs.tensors)


def test_decode_that_gives_up_before_prefill_starts_leaves_no_kv_held_for_the_lease(m3):
    # Concurrent flow, a client that hangs up at once: decode's abort reaches prefill before prefill even started
    # the request. Prefill must not then keep that request's KV for its 120 s lease.
    with sender_and_receiver(m3, "early-abort", lease_s=120.0) as (prefill, sender, port, decode, receiver):
        decode.run(receiver.abort_unregistered("t-early", PrefillAddress("127.0.0.1", port), "client left"), 10)
        deadline = time.monotonic() + 5
        while "t-early" not in sender.ownership.given_up and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "t-early" in sender.ownership.given_up, "prefill never heard of the abort"
        sender.start_request("t-early", TOKENS)
        sender.begin_chunk("t-early", pick_blocks(TOKENS, BLOCK, prefill.spec.num_blocks, seed=8), TOKENS)
        sender.end_chunk("t-early")
        started = time.monotonic()
        assert prefill.run(sender.wait_finished("t-early", 10), 15) is False  # released unsent, not kept
        assert time.monotonic() - started < 5 and "t-early" not in sender.requests


def test_transfers_over_one_connection_leave_nothing_alive_on_it(m3):
    """Retention: a decode connection lives as long as heartbeats keep it open, so what a transfer leaves on it
    must go when the transfer does. 40 transfers over one connection (half registered before prefill started them,
    half after) leave no SendRequest alive after gc.collect(), and no callback per transfer on the connection (the
    sender cleans up once per connection when it closes, as httpcore's pool sweeps its closed connections)."""
    import gc

    from connector.engine.sender_state import SendRequest

    n = 40
    with sender_and_receiver(m3, "keep") as (prefill, sender, port, decode, receiver):
        addr = PrefillAddress("127.0.0.1", port)
        for i in range(n):
            tid = f"t-keep-{i}"
            blocks = pick_blocks(TOKENS, BLOCK, prefill.spec.num_blocks, seed=i)
            dst = pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=1000 + i)
            got = None
            if i % 2:  # decode first: the registration waits for prefill to start the request
                got = decode.loop.submit(receiver.receive(RecvSpec(tid, str(addr), dst, 0, TOKENS)))
                deadline = time.monotonic() + 15
                while sender.parked_count == 0:
                    assert time.monotonic() < deadline, f"{tid} never waited for its request"
                    time.sleep(0.005)
            sender.start_request(tid, TOKENS)
            sender.begin_chunk(tid, blocks, TOKENS)
            sender.end_chunk(tid)
            if got is None:
                decode.run(receiver.receive(RecvSpec(tid, str(addr), dst, 0, TOKENS)), 30)
            else:
                got.result(30)
            assert prefill.run(sender.wait_finished(tid, 10), 15) is True
        [conn] = sender.server.connections
        assert sender.stats.sends_ok == n and not sender.requests and sender.parked_count == 0

        def left() -> tuple[int, int]:
            gc.collect()
            alive = sum(1 for o in gc.get_objects() if type(o) is SendRequest and o.transfer_id.startswith("t-keep"))
            return alive, len(conn.closed._callbacks or ())  # (asyncio's Future keeps its callbacks there)

        assert prefill.run(asyncio.to_thread(left), 15) == (0, 1)  # the one: the server's end of the connection


def test_what_prefill_keeps_of_released_transfers_stays_within_its_bound(m3):
    """Prefill remembers released transfer ids (RecentIds, at most `max_ids`, the oldest pushed out first) and how
    each ended. The outcome was kept in a second table pruned only as ids expired by age, so ids pushed out by the
    bound left their outcome behind for good: past 65,536 transfers within `released_memory_s` one entry per
    request, forever (tools/soak.py found it). 12 transfers with a bound of 4 keep 4 of each."""
    import gc

    from connector.engine.sender_state import FinishedInfo

    with sender_and_receiver(m3, "bound") as (prefill, sender, port, decode, receiver):
        sender.ownership.released.max_ids = 4
        addr = PrefillAddress("127.0.0.1", port)
        for i in range(12):
            tid = f"t-bound-{i}"
            sender.start_request(tid, TOKENS)
            sender.begin_chunk(tid, pick_blocks(TOKENS, BLOCK, prefill.spec.num_blocks, seed=i), TOKENS)
            sender.end_chunk(tid)
            decode.run(receiver.receive(RecvSpec(tid, str(addr),
                                                 pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=50 + i), 0,
                                                 TOKENS)), 30)
            assert prefill.run(sender.wait_finished(tid, 10), 15) is True
        assert len(sender.ownership.released) == 4

        def outcomes() -> int:
            gc.collect()
            return sum(1 for o in gc.get_objects() if type(o) is FinishedInfo)

        assert prefill.run(asyncio.to_thread(outcomes), 15) == 4
        assert sender.finished_info("t-bound-11").ok and sender.finished_info("t-bound-0") is None


def test_an_idle_sender_keeps_no_request_alive(m3):
    """The lease check runs every second over the live requests. Its loop variable stayed in the lease task's frame
    between ticks, so the last request it saw (with its destination, that destination's connection and peer) stayed
    alive for as long as no other request came (tools/soak.py found one kept after peer churn). A transfer whose
    WRITE outlasts a tick, then an idle sender: nothing of it is alive."""
    import gc

    from connector.engine.sender_state import Destination, SendRequest

    with sender_and_receiver(m3, "idle") as (prefill, sender, port, decode, receiver):
        real_write = sender.transport.write

        async def slow_write(*args, **kwargs):
            await asyncio.sleep(1.5)  # the lease check runs (at least once) while the request is live
            return await real_write(*args, **kwargs)

        sender.transport.write = slow_write
        sender.start_request("t-idle", TOKENS)
        sender.begin_chunk("t-idle", pick_blocks(TOKENS, BLOCK, prefill.spec.num_blocks, seed=1), TOKENS)
        sender.end_chunk("t-idle")
        decode.run(receiver.receive(RecvSpec("t-idle", f"127.0.0.1:{port}",
                                             pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=2), 0, TOKENS)),
                   30)
        assert prefill.run(sender.wait_finished("t-idle", 10), 15) is True
        time.sleep(1.2)  # a tick of the idle sender

        def alive() -> list[str]:
            gc.collect()
            return [type(o).__name__ for o in gc.get_objects() if type(o) in (SendRequest, Destination)]

        assert prefill.run(asyncio.to_thread(alive), 15) == []
