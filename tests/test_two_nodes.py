"""Prefill and decode on two "nodes": each side's rank processes in a network namespace of their own, a veth pair
between them, UCX forced onto TCP over it (sparse_kv_lab.sim.netns). Every test checks that the veth carried about the
bytes that moved, so none can pass over shared memory. The link is cut, flapped, rate-limited and lossy; ranks are
killed across it. Real NIXL between real processes, no fakes; skipped (reason printed) without namespaces."""

from __future__ import annotations

import threading
import time

import pytest

from connector.engine.config import SideChannelConfig, lost_source_hold_s
from sparse_kv_lab.sim.cluster import Cluster
from sparse_kv_lab.sim.spec import Placement
from tests.helpers import scenario

pytestmark = pytest.mark.slow
MiB = 1 << 20
SIDE_CHANNEL = SideChannelConfig(heartbeat_interval_s=0.5, dead_after_s=4.0)
USER_TIMEOUT_S = 2.0
HOLD_S = lost_source_hold_s(USER_TIMEOUT_S, SIDE_CHANNEL.heartbeat_interval_s)


def on_two_nodes(net, model, prefill="tp=1,pp=1", decode="tp=1,pp=1", **kw):
    """Prefill on node a, decode on node b, short liveness settings (a cut link shows within seconds)."""
    kw.setdefault("tcp_user_timeout_s", USER_TIMEOUT_S)
    return scenario(model, prefill, decode, prefill_node=Placement.node(net.a.host, net.a.netns, net.a.dev),
                    decode_node=Placement.node(net.b.host, net.b.netns, net.b.dev), side_channel=SIDE_CHANNEL,
                    write_timeout_s=20.0, **kw)


def assert_on_the_wire(net, tx_before: int, moved: int, slack: float = 0.15) -> int:
    """Node a's veth sent at least the bytes decode received, and not much more (TCP/UCX headers, side channel,
    retransmissions)."""
    sent = net.counters("a")["tx_bytes"] - tx_before
    assert moved <= sent <= (1 + slack) * moved + 4 * MiB, f"veth sent {sent} B for {moved} B moved"
    return sent


def begin(cluster: Cluster, tid: str, seed: int, layer_ms: float) -> None:
    """Every decode rank registers, every prefill rank starts computing; returns while prefill computes."""
    sc = cluster.sc
    for rank, (_, dconn) in cluster.decode.items():
        cluster.ask(dconn, ("receive", tid, sc.tokens, 0, str(cluster.prefill_address), seed), 30, ("decode", rank))
    for rank, (_, pconn) in cluster.prefill.items():
        cluster.ask(pconn, ("start", tid, sc.tokens, seed), 30, ("prefill", rank))
    for _, pconn in cluster.prefill.values():
        pconn.send(("chunk", tid, 0, sc.tokens, layer_ms, "stream", "all"))


def settle_all(cluster: Cluster, tid: str, since: float, limit_s: float = 60.0) -> dict[tuple, tuple[float, tuple]]:
    """Wait for every prefill rank to finish the request (released) and every decode rank to collect it: per
    ("prefill" | "decode", rank), (seconds since `since`, answer), as each one happens."""
    for _, dconn in cluster.decode.values():
        dconn.send(("collect", tid))
    for rank, (_, pconn) in cluster.prefill.items():
        cluster.reply(pconn, limit_s, ("prefill", rank))  # its compute ends whatever the link does
        pconn.send(("finish", tid))
    waiting = {("prefill", r): c for r, (_, c) in cluster.prefill.items()}
    waiting |= {("decode", r): c for r, (_, c) in cluster.decode.items()}
    out = {}
    while waiting:
        assert time.monotonic() - since < limit_s, f"{sorted(waiting)} did not settle within {limit_s} s"
        for who, conn in list(waiting.items()):
            if conn.poll(0.02):
                out[who] = (time.monotonic() - since, conn.recv())
                del waiting[who]
    return out


def settle(cluster: Cluster, tid: str, since: float, limit_s: float = 60.0) -> dict[str, tuple[float, tuple]]:
    """`settle_all` for one rank on each side: {"prefill": ..., "decode": ...}."""
    return {side: got for (side, _rank), got in settle_all(cluster, tid, since, limit_s).items()}


def state(cluster: Cluster, side: str, rank: tuple[int, int] = (0, 0)) -> dict:
    table = cluster.prefill if side == "prefill" else cluster.decode
    return cluster.ask(table[rank][1], ("state",), 30, side)[1]


def test_byte_exact_across_two_nodes_prefill_pp2_tp2(two_nodes, m3, cluster):
    sc = on_two_nodes(two_nodes, m3, "tp=2,pp=2", "tp=1,pp=1", tokens=200, requests=2)
    workers = cluster(sc)
    before = two_nodes.counters("a")["tx_bytes"]
    results = [workers.run_request(i) for i in range(sc.requests)]
    assert all(r.verified for r in results), [r.problems for r in results]
    moved = sum(r.bytes for r in results)
    sent = assert_on_the_wire(two_nodes, before, moved)
    print(f"\n{moved / MiB:.1f} MiB from 4 prefill ranks in {two_nodes.a.netns} to decode in {two_nodes.b.netns}; "
          f"the veth sent {sent / MiB:.1f} MiB")


@pytest.mark.parametrize("cut,back_after_s", [("a", None), ("b", None), ("a", 5.0)],
                         ids=["cut-on-prefill-node", "cut-on-decode-node", "back-during-decode-hold"])
def test_link_cut_mid_transfer_fails_both_sides_in_bounded_time_then_works_again(two_nodes, m3, cluster, cut,
                                                                                 back_after_s):
    """The link goes down while a WRITE is on it. Prefill's WRITE ends within the UCX TCP user timeout (the kernel's
    tcp_retries2 stays at its default, 15) and the request is released; decode fails the transfer after dead_after
    plus the hold, and nothing lands in its cache afterwards, also once the link is back. A link back while decode
    holds the blocks lets it ask prefill again, which confirms it writes nothing more: decode fails earlier. Then a
    new request works over the same processes."""
    sc = on_two_nodes(two_nodes, m3, tokens=256)
    workers = cluster(sc)
    assert workers.run_request(0).verified  # connected, warm
    two_nodes.shape("a", "40mbit", "32kb", "1mb")  # ~5 MB/s: the 35 MB request is still on the wire at the cut
    tid = f"{workers.run_id}-cut"
    begin(workers, tid, seed=1, layer_ms=30.0)
    time.sleep(1.5)
    cut_at = time.monotonic()
    two_nodes.link(cut, up=False)
    if back_after_s is not None:
        threading.Timer(back_after_s, two_nodes.link, (cut, True)).start()
    out = settle(workers, tid, cut_at)
    (decode_s, collected), (prefill_s, finished) = out["decode"], out["prefill"]
    print(f"\ncut on node {cut}: prefill released the request after {prefill_s:.2f} s, decode failed it after "
          f"{decode_s:.2f} s ({collected[1]})")
    assert collected[1] and collected[1][0].startswith("transfer failed"), collected
    assert finished[1] is False
    assert prefill_s < SIDE_CHANNEL.dead_after_s + USER_TIMEOUT_S + 3
    if back_after_s is None:
        assert SIDE_CHANNEL.dead_after_s - 1 < decode_s < SIDE_CHANNEL.dead_after_s + HOLD_S + 3
    else:  # confirmed by prefill once the link was back, before the hold ran out
        assert back_after_s < decode_s < SIDE_CHANNEL.dead_after_s - 0.5 + HOLD_S
    held = state(workers, "prefill")
    assert {k: held[k] for k in ("requests", "open_handles", "inflight_bytes", "sends_failed", "parked")} == {
        "requests": 0, "open_handles": 0, "inflight_bytes": 0, "sends_failed": 1, "parked": 0}, held
    assert state(workers, "decode") == {"pending": 0, "confirming": 0}
    _, dconn = workers.decode[(0, 0)]
    handed_back = workers.ask(dconn, ("digest",), 30, "decode")
    two_nodes.link(cut, up=True)
    time.sleep(3.0)  # anything still queued on prefill's side would land now
    assert workers.ask(dconn, ("digest",), 30, "decode") == handed_back, "bytes landed after decode gave up"
    again = workers.run_request(2)
    assert again.verified, again.problems


@pytest.mark.parametrize("prefill", ["tp=2,pp=1", "tp=2,pp=2"])
def test_a_cut_link_fails_every_decode_rank_of_a_tp2_decode_in_bounded_time(two_nodes, m3, cluster, capfd,
                                                                              prefill):
    """TP2 on both sides (and TP2 x PP2 -> TP2): each decode rank has a connection to a prefill rank that owes it
    nothing and completed at once. Whichever of a decode rank's connections times out first after the cut, every
    decode rank fails the transfer within dead_after plus the hold (none waits out the transfer timeout), every
    prefill rank releases the request, and no rank holds anything afterwards. UCX prints its own errors after a
    cut; none of it reaches standard output (where `demo --json` prints its JSON)."""
    sc = on_two_nodes(two_nodes, m3, prefill, "tp=2,pp=1", tokens=256)
    workers = cluster(sc)
    assert workers.run_request(0).verified  # connected, warm
    two_nodes.shape("a", "40mbit", "32kb", "1mb")  # ~5 MB/s: the request is still on the wire at the cut
    tid = f"{workers.run_id}-cut-tp2"
    begin(workers, tid, seed=1, layer_ms=30.0)
    time.sleep(1.5)
    cut_at = time.monotonic()
    two_nodes.link("a", up=False)
    out = settle_all(workers, tid, cut_at)
    printed = capfd.readouterr()
    assert "UCX" not in printed.out, f"UCX wrote to standard output: {printed.out[-2000:]}"
    print(f"\nUCX lines on standard error: {sum('UCX' in line for line in printed.err.splitlines())}")
    for who, (took, answer) in sorted(out.items()):
        print(f"{who}: {took:.2f} s after the cut: {answer[1] if who[0] == 'prefill' else answer[1][:1]}")
    decode_bound = SIDE_CHANNEL.dead_after_s + HOLD_S + 3
    for rank in workers.decode:
        took, collected = out[("decode", rank)]
        assert collected[1] and collected[1][0].startswith("transfer failed"), (rank, collected)
        assert took < decode_bound, f"decode rank {rank} failed only {took:.1f} s after the cut: {collected[1]}"
    released = {rank: out[("prefill", rank)] for rank in workers.prefill}
    assert all(took < SIDE_CHANNEL.dead_after_s + USER_TIMEOUT_S + 3 for took, _ in released.values()), released
    assert not all(answer[1] for _, answer in released.values()), "no prefill rank saw the transfer fail"
    for rank in workers.prefill:
        held = state(workers, "prefill", rank)
        assert {k: held[k] for k in ("requests", "open_handles", "inflight_bytes", "parked")} == {
            "requests": 0, "open_handles": 0, "inflight_bytes": 0, "parked": 0}, (rank, held)
    for rank in workers.decode:
        assert state(workers, "decode", rank) == {"pending": 0, "confirming": 0}, rank
    two_nodes.link("a", up=True)
    again = workers.run_request(2)
    assert again.verified, again.problems


def test_a_flap_shorter_than_the_timeouts_is_survived(two_nodes, m3, cluster):
    sc = on_two_nodes(two_nodes, m3, tokens=256, tcp_user_timeout_s=6.0)
    workers = cluster(sc)
    assert workers.run_request(0).verified
    two_nodes.shape("a", "40mbit", "32kb", "1mb")
    before = two_nodes.counters("a")["tx_bytes"]
    tid = f"{workers.run_id}-flap"
    begin(workers, tid, seed=1, layer_ms=30.0)
    time.sleep(1.0)
    down_at = time.monotonic()
    two_nodes.link("a", up=False)
    time.sleep(1.0)
    two_nodes.link("a", up=True)
    out = settle(workers, tid, down_at)
    _, collected = out["decode"]
    assert collected[1] == [], collected[1]
    assert out["prefill"][1][1] is True
    assert_on_the_wire(two_nodes, before, collected[2], slack=0.3)
    assert state(workers, "prefill")["reconnects"] == 0
    print(f"\n1 s flap: the request completed {out['decode'][0]:.2f} s after the link went down")


def test_rate_limited_lossy_link_still_verifies(two_nodes, m3, cluster):
    """A token bucket with a queue smaller than a burst drops packets (netem is not in every kernel): TCP
    retransmits, every byte still arrives right."""
    sc = on_two_nodes(two_nodes, m3, "tp=1,pp=2", tokens=128)
    workers = cluster(sc)
    two_nodes.shape("a", "200mbit", "16kb", "16kb")
    before = two_nodes.counters("a")["tx_bytes"]
    result = workers.run_request(0)
    assert result.verified, result.problems
    drops = two_nodes.qdisc_drops("a")
    assert drops > 0, "the shaped link dropped nothing: it tested no loss"
    sent = assert_on_the_wire(two_nodes, before, result.bytes, slack=0.5)
    print(f"\nlossy link: {result.bytes / MiB:.1f} MiB verified, {sent / MiB:.1f} MiB sent, {drops} packets dropped")


@pytest.mark.parametrize("killed", ["prefill", "decode"])
def test_a_rank_killed_across_the_link_fails_the_other_side_fast(two_nodes, m3, cluster, killed):
    """A dead process's kernel resets its connections: the other side learns at once, not after dead_after. Decode
    checks that the prefill rank is gone (its port refuses) before handing blocks back."""
    sc = on_two_nodes(two_nodes, m3, tokens=256)
    workers = cluster(sc)
    assert workers.run_request(0).verified
    two_nodes.shape("a", "40mbit", "32kb", "1mb")
    tid = f"{workers.run_id}-kill"
    begin(workers, tid, seed=1, layer_ms=30.0)
    time.sleep(1.5)
    victim, _ = (workers.prefill if killed == "prefill" else workers.decode)[(0, 0)]
    killed_at = time.monotonic()
    victim.kill()
    if killed == "prefill":
        _, dconn = workers.decode[(0, 0)]
        collected = workers.ask(dconn, ("collect", tid), 30, "decode")
        took = time.monotonic() - killed_at
        assert collected[1] and "went away" in collected[1][0], collected[1]
        assert state(workers, "decode") == {"pending": 0, "confirming": 0}
    else:
        _, pconn = workers.prefill[(0, 0)]
        workers.reply(pconn, 30, "prefill")  # compute done
        finished = workers.ask(pconn, ("finish", tid), 30, "prefill")
        took = time.monotonic() - killed_at
        assert finished[1] is False
        assert state(workers, "prefill")["requests"] == 0
    print(f"\n{killed} killed: the other side gave the request up after {took:.2f} s")
    assert took < SIDE_CHANNEL.dead_after_s
