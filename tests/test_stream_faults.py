"""Bad input and dead peers against the real engine: one side is a worker process, the other runs in the test
process, both on real NIXL. Each case must fail clearly, write nothing, and leave no state behind."""

from __future__ import annotations

import contextlib
import socket
import time
import uuid

import pytest
import torch

from connector.core.errors import ControlError, TransferFailed
from connector.core.hf_config import load_model
from connector.core.layout import ParallelLayout
from connector.engine.config import ReceiverConfig, SenderConfig, SideChannelConfig
from connector.engine.rank import LocalRank
from connector.engine.receiver import StreamReceiver
from connector.engine.sender import StreamSender
from connector.protocol.addressing import PrefillAddress
from connector.protocol.messages import Register, RegisterError
from connector.sim.buffers import RankBuffers, pick_blocks
from connector.sim.cluster import Cluster, Scenario
from connector.sim.env import apply_env
from connector.transport.control import connect
from connector.transport.loop import LoopThread

pytestmark = pytest.mark.slow
TOKENS, BLOCK = 64, 16


class InProcess:
    """One rank living in the test process: loop thread, real NIXL transport, simulated cache."""

    def __init__(self, side: str, sc: Scenario, rank=(0, 0)) -> None:
        from connector.transport.nixl import Transport, TransportConfig

        apply_env()
        self.sc, self.rank = sc, rank
        self.parallel = sc.prefill if side == "prefill" else sc.decode
        self.lt = LoopThread().start()
        self.transport = Transport(TransportConfig(name=f"test-{side}-{uuid.uuid4().hex[:6]}"))
        self.lt.run(self.transport.open(), 30)
        self.num_blocks = 2 * -(-sc.tokens // sc.block_size) + 8
        self.bufs = RankBuffers(sc.model, self.parallel, rank, sc.block_size, self.num_blocks)
        for tensor in self.bufs.tensors:
            self.transport.register(tensor)

    def me(self, engine_id: str, staging=None) -> LocalRank:
        return LocalRank(engine_id, self.sc.model, self.parallel, self.rank, tuple(self.bufs.regions()),
                         self.sc.block_size, staging=staging)

    def close(self, engine) -> None:
        if engine is not None:
            self.lt.run(engine.aclose(), 30)
        self.lt.run(self.transport.aclose(), 30)
        self.lt.stop()


def make_scenario(prefill="tp=1,pp=1", layer_ms=0.0) -> Scenario:
    model = load_model("minimax-m3")
    tp, pp = (int(x.split("=")[1]) for x in prefill.split(","))
    return Scenario(model=model, prefill=ParallelLayout.build(60, tp, pp), decode=ParallelLayout.build(60, 1, 1),
                    tokens=TOKENS, block_size=BLOCK, layer_ms=layer_ms, timeout_s=30.0)


@pytest.fixture
def prefill_cluster_and_decode():
    made = []

    def make(prefill="tp=1,pp=1", layer_ms=0.0):
        sc = make_scenario(prefill, layer_ms)
        cluster = Cluster(sc, spawn=("prefill",)).__enter__()
        decode = InProcess("decode", sc)
        receiver = StreamReceiver(decode.me("test-decode"), decode.transport,
                                  ReceiverConfig(SideChannelConfig(dead_after_s=3.0), transfer_timeout_s=20.0))
        made.append((cluster, decode, receiver))
        return sc, cluster, decode, receiver

    yield make
    for cluster, decode, receiver in made:
        cluster.close()
        decode.close(receiver)


@contextlib.contextmanager
def sender_and_receiver(tag: str, *, lease_s: float = 120.0, staging_bytes: int = 0):
    """A started StreamSender and a StreamReceiver, each in its own InProcess rank (M3, TP1/PP1), optionally with
    registered staging buffers. Yields (prefill, sender, port, decode, receiver); everything made is closed."""
    sc = make_scenario()
    made: list[tuple[InProcess, object]] = []
    try:
        prefill = InProcess("prefill", sc)
        made.append((prefill, None))
        decode = InProcess("decode", sc)
        made.append((decode, None))
        staging = [None, None]
        if staging_bytes:
            staging = [torch.zeros(staging_bytes, dtype=torch.uint8) for _ in range(2)]
            prefill.transport.register(staging[0])
            decode.transport.register(staging[1])
        sender = StreamSender(prefill.me(f"test-prefill-{tag}", staging[0]), prefill.transport,
                              SenderConfig(port=0, lease_s=lease_s), prefill.lt.loop)
        made[0] = (prefill, sender)
        config = ReceiverConfig(**({"staging_slot_bytes": staging_bytes} if staging_bytes else {}))
        receiver = StreamReceiver(decode.me(f"test-decode-{tag}", staging[1]), decode.transport, config)
        made[1] = (decode, receiver)
        port = prefill.lt.run(sender.start(), 10)
        yield prefill, sender, port, decode, receiver
    finally:
        for side, engine in reversed(made):
            side.close(engine)


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
    blocks = pick_blocks(TOKENS, BLOCK, decode.num_blocks, seed=1)
    blocks[0][2] = decode.num_blocks + 5
    addr = PrefillAddress("127.0.0.1", cluster.base_port)
    with pytest.raises(TransferFailed, match=rf"block ids \[{decode.num_blocks + 5}\] are outside kv layer 0"):
        decode.lt.run(receiver.receive("t-bad-blocks", addr, blocks, 0, TOKENS), 30)
    time.sleep(0.3)
    assert not any(bool(t.any()) for t in decode.bufs.tensors), "bytes were written for a refused registration"


def test_unknown_transfer_id_and_foreign_layer_are_refused(prefill_cluster_and_decode):
    sc, cluster, decode, receiver = prefill_cluster_and_decode("tp=1,pp=2")
    start_prefill(cluster, "t-layers")

    async def register(port: int, **fields) -> object:
        conn = await connect("127.0.0.1", port, receiver.hello, timeout=10)
        try:
            reg = dict(transfer_id="t-layers", dst_pp=0, dst_tp=0,
                       block_ids=pick_blocks(TOKENS, BLOCK, decode.num_blocks, seed=2), first_token=0,
                       num_tokens=TOKENS, layers=[])
            reg.update(fields)
            await conn.send(Register(**reg))
            return await conn.recv(timeout=10)
        finally:
            await conn.aclose()

    # stage 0 holds layers 0-29: asking it for layer 59 is refused, naming the layer
    reply = decode.lt.run(register(cluster.base_port, layers=[3, 59]), 30)
    assert isinstance(reply, RegisterError) and "layers [59]" in reply.reason and "layer split" in reply.reason
    reply = decode.lt.run(register(cluster.base_port, num_tokens=TOKENS + 1), 30)
    assert isinstance(reply, RegisterError) and "prompt tokens" in reply.reason
    assert not any(bool(t.any()) for t in decode.bufs.tensors)


def test_incompatible_fingerprint_and_garbage_frames_leave_the_server_serving(prefill_cluster_and_decode):
    import msgspec

    sc, cluster, decode, receiver = prefill_cluster_and_decode()
    bad = msgspec.structs.replace(receiver.hello, fingerprint="0" * 16)
    with pytest.raises(ControlError, match="fingerprint mismatch: peer has 0000000000000000"):
        decode.lt.run(connect("127.0.0.1", cluster.base_port, bad, timeout=10), 30)
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
    blocks = pick_blocks(TOKENS, BLOCK, decode.num_blocks, seed=3)
    res = decode.lt.run(receiver.receive("t-after-garbage", PrefillAddress("127.0.0.1", cluster.base_port),
                                         blocks, 0, TOKENS), 30)
    assert res.bytes_written > 0
    assert decode.bufs.verify(blocks, 0, TOKENS) == []


def test_prefill_killed_mid_transfer_fails_the_receiver_within_its_timeout(prefill_cluster_and_decode):
    sc, cluster, decode, receiver = prefill_cluster_and_decode(layer_ms=100.0)
    blocks = pick_blocks(TOKENS, BLOCK, decode.num_blocks, seed=4)
    fut = decode.lt.submit(receiver.receive("t-kill-p", PrefillAddress("127.0.0.1", cluster.base_port), blocks, 0,
                                            TOKENS))
    start_prefill(cluster, "t-kill-p", layer_ms=100.0, wait=False)  # 60 layers x 100 ms
    time.sleep(1.5)
    assert not fut.done()
    proc, _conn = cluster.prefill[(0, 0)]
    proc.kill()
    began = time.monotonic()
    with pytest.raises(TransferFailed, match="went away"):
        fut.result(15)
    assert time.monotonic() - began < 10


def test_decode_killed_mid_transfer_frees_the_sender_state():
    sc = make_scenario(layer_ms=0.0)
    cluster = Cluster(sc, spawn=("decode",)).__enter__()
    prefill = InProcess("prefill", sc)
    sender = StreamSender(prefill.me("test-prefill"), prefill.transport,
                          SenderConfig(port=cluster.base_port, lease_s=30), prefill.lt.loop)
    try:
        prefill.lt.run(sender.start(), 10)
        tid = "t-kill-d"
        blocks = pick_blocks(TOKENS, BLOCK, prefill.num_blocks, seed=5)
        sender.start_request(tid, TOKENS)
        sender.begin_chunk(tid, blocks, TOKENS)
        _, conn = cluster.decode[(0, 0)]
        cluster.ask(conn, ("receive", tid, TOKENS, 0, f"127.0.0.1:{cluster.base_port}", 0), 30, "decode")
        deadline = time.monotonic() + 10
        while not sender.requests.get(tid) or not sender.requests[tid].dests:
            assert time.monotonic() < deadline, "decode never registered"
            time.sleep(0.05)
        for layer in range(20):
            prefill.bufs.fill(layer, blocks, 0, TOKENS)
            sender.layer_ready(tid, layer)
        proc, _ = cluster.decode[(0, 0)]
        proc.kill()
        for layer in range(20, 60):
            prefill.bufs.fill(layer, blocks, 0, TOKENS)
        sender.end_chunk(tid)
        began = time.monotonic()
        ok = prefill.lt.run(sender.wait_finished(tid, 20), 25)
        assert ok is False
        assert time.monotonic() - began < 15
        assert tid not in sender.requests and not sender._parked
        assert prefill.transport.inflight_bytes == 0
    finally:
        cluster.close()
        prefill.close(sender)


def test_decode_abort_waits_until_prefill_stopped_writing(prefill_cluster_and_decode):
    sc, cluster, decode, receiver = prefill_cluster_and_decode(layer_ms=60.0)
    blocks = pick_blocks(TOKENS, BLOCK, decode.num_blocks, seed=6)
    fut = decode.lt.submit(receiver.receive("t-abort-d", PrefillAddress("127.0.0.1", cluster.base_port), blocks, 0,
                                            TOKENS))
    start_prefill(cluster, "t-abort-d", layer_ms=60.0, wait=False)  # 60 layers x 60 ms
    time.sleep(1.5)
    assert not fut.done()
    decode.lt.run(receiver.abort("t-abort-d", "client went away"), 10)
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


def test_lease_frees_a_finished_request_that_decode_never_registers():
    sc = make_scenario()
    prefill = InProcess("prefill", sc)
    sender = StreamSender(prefill.me("test-prefill"), prefill.transport, SenderConfig(port=0, lease_s=1.0),
                          prefill.lt.loop)
    finished = []
    sender.on_finished = lambda tid, ok: finished.append((tid, ok))
    try:
        prefill.lt.run(sender.start(), 10)
        blocks = pick_blocks(TOKENS, BLOCK, prefill.num_blocks, seed=7)
        sender.start_request("t-lease", TOKENS)
        sender.begin_chunk("t-lease", blocks, TOKENS)
        sender.end_chunk("t-lease")  # prefill done; no decode ever registers
        began = time.monotonic()
        assert prefill.lt.run(sender.wait_finished("t-lease", 10), 15) is False
        assert 0.9 < time.monotonic() - began < 5
        assert finished == [("t-lease", False)] and "t-lease" not in sender.requests
    finally:
        prefill.close(sender)


def test_decode_abort_before_registering_frees_prefill_without_waiting_for_the_lease(prefill_cluster_and_decode):
    sc, cluster, decode, receiver = prefill_cluster_and_decode()
    start_prefill(cluster, "t-abort-early")  # prefill computed everything; its lease is 120 s
    decode.lt.run(receiver.abort_unregistered("t-abort-early", PrefillAddress("127.0.0.1", cluster.base_port),
                                              "client went away"), 20)
    began = time.monotonic()
    _, conn = cluster.prefill[(0, 0)]
    ok = cluster.ask(conn, ("finish", "t-abort-early"), 30, "prefill")
    assert ok[1] is False and time.monotonic() - began < 5
    assert not any(bool(t.any()) for t in decode.bufs.tensors)


def test_prefill_restart_after_preemption_resends_from_the_new_blocks(prefill_cluster_and_decode):
    """vLLM may preempt a prefill and recompute it into other blocks: what was streamed from the old blocks must
    not count, and decode must end up with the bytes of the recomputation."""
    sc, cluster, decode, receiver = prefill_cluster_and_decode()
    prefill = InProcess("prefill", sc)
    sender = StreamSender(prefill.me("test-prefill-2"), prefill.transport, SenderConfig(port=cluster.base_port + 1),
                          prefill.lt.loop)
    try:
        prefill.lt.run(sender.start(), 10)
        addr = PrefillAddress("127.0.0.1", cluster.base_port + 1)
        dst = pick_blocks(TOKENS, BLOCK, decode.num_blocks, seed=8)
        fut = decode.lt.submit(receiver.receive("t-preempt", addr, dst, 0, TOKENS))
        old = pick_blocks(TOKENS, BLOCK, prefill.num_blocks, seed=9)
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
        new = pick_blocks(TOKENS, BLOCK, prefill.num_blocks, seed=10)
        sender.begin_chunk("t-preempt", new, TOKENS)  # recomputed from scratch into new blocks, in one go
        for layer in range(60):
            prefill.bufs.fill(layer, new, 0, TOKENS)
        sender.end_chunk("t-preempt")
        fut.result(30)
        assert decode.bufs.verify(dst, 0, TOKENS) == []
    finally:
        prefill.close(sender)


def test_decode_heartbeats_extend_the_lease():
    """A finished request waits past its 1 s lease while decode keeps listing it in heartbeats, then completes."""
    with sender_and_receiver("hb", lease_s=1.0) as (prefill, sender, port, decode, receiver):
        blocks = pick_blocks(TOKENS, BLOCK, prefill.num_blocks, seed=11)
        sender.start_request("t-hb", TOKENS)
        sender.begin_chunk("t-hb", blocks, TOKENS)
        for layer in range(60):
            prefill.bufs.fill(layer, blocks, 0, TOKENS)
        sender.end_chunk("t-hb")  # finished; the lease (1 s) starts now

        async def keep_alive():
            return await connect("127.0.0.1", port, receiver.hello, timeout=10, heartbeat_interval_s=0.2,
                                 heartbeat_ids=lambda: ["t-hb"])

        beating = decode.lt.run(keep_alive(), 15)
        time.sleep(3.0)  # three leases long
        assert "t-hb" in sender.requests, "the lease expired although decode kept heartbeating"
        dst = pick_blocks(TOKENS, BLOCK, decode.num_blocks, seed=12)
        decode.lt.run(receiver.receive("t-hb", PrefillAddress("127.0.0.1", port), dst, 0, TOKENS), 30)
        assert prefill.lt.run(sender.wait_finished("t-hb", 10), 15) is True
        assert decode.bufs.verify(dst, 0, TOKENS) == []
        decode.lt.run(beating.aclose(), 10)


def test_sender_counts_bytes_streamed_during_compute_apart_from_the_sweep():
    """SenderStats (the source of the vLLM metrics): a layer written while its request still computes counts as
    streamed; what the final sweep sends does not; a completed transfer counts as ok."""
    def wait_for(check, what: str) -> None:
        deadline = time.monotonic() + 15
        while not check():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    with sender_and_receiver("st") as (prefill, sender, port, decode, receiver):
        blocks = pick_blocks(TOKENS, BLOCK, prefill.num_blocks, seed=21)
        dst = pick_blocks(TOKENS, BLOCK, decode.num_blocks, seed=22)
        sender.start_request("t-st", TOKENS)
        sender.begin_chunk("t-st", blocks, TOKENS)
        got = decode.lt.submit(receiver.receive("t-st", PrefillAddress("127.0.0.1", port), dst, 0, TOKENS))
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
        assert prefill.lt.run(sender.wait_finished("t-st", 10), 15) is True
        assert decode.bufs.verify(dst, 0, TOKENS) == []
        stats = sender.stats
        assert stats.bytes_sent_during_compute == streamed < stats.bytes_sent
        assert (stats.sends_ok, stats.sends_failed) == (1, 0)
        # every NIXL WRITE was timed: posting it, and from the post to its completion
        assert len(stats.transfer_seconds) == len(stats.post_seconds) == stats.writes
        assert all(0 < p <= t for p, t in zip(stats.post_seconds, stats.transfer_seconds))


def test_decode_refuses_a_staged_chunk_aimed_outside_its_blocks():
    """Staging lets prefill name decode-side addresses in a side-channel message, so decode checks them: a chunk
    whose destinations are not inside the blocks registered for the transfer is refused, nothing is written, and
    the transfer fails on both sides with the reason."""
    import numpy as np

    with sender_and_receiver("evil", staging_bytes=1 << 20) as (prefill, sender, port, decode, receiver):
        dst = pick_blocks(TOKENS, BLOCK, decode.num_blocks, seed=32)
        outside = next(b for b in range(decode.num_blocks) if b not in dst[0])
        region = decode.bufs.regions()[0]
        real = sender.staged._scatter

        async def aimed_elsewhere(key, conn, tid, nbytes, destinations):
            evil = np.array(destinations, dtype=np.int64)
            evil[:, 0] = region.base_addr + outside * region.block_stride  # a block decode did not register
            return await real(key, conn, tid, nbytes, evil)

        sender.staged._scatter = aimed_elsewhere
        blocks = pick_blocks(TOKENS, BLOCK, prefill.num_blocks, seed=31)
        for layer in range(60):
            prefill.bufs.fill(layer, blocks, 0, TOKENS)
        sender.start_request("t-evil", TOKENS)
        sender.begin_chunk("t-evil", blocks, TOKENS)
        sender.end_chunk("t-evil")
        with pytest.raises(TransferFailed, match="decode refused staged chunk .* outside the blocks registered"):
            decode.lt.run(receiver.receive("t-evil", PrefillAddress("127.0.0.1", port), dst, 0, TOKENS), 30)
        assert prefill.lt.run(sender.wait_finished("t-evil", 10), 15) is False
        assert not any(bool(t.any()) for t in decode.bufs.tensors), "a refused chunk wrote into decode's cache"
