"""A short soak (sparse_kv_lab.sim.soak; tools/soak.py runs it long): a prefill process and a decode process on real
NIXL, many small requests back to back, each process sampling itself. Nothing may grow per request: the engines'
per-transfer tables go back to empty (or stay within their documented bound), the per-transfer objects back to the
baseline, fds and threads back to the baseline, and RSS grows less than a per-request leak of a few KB would make it.
Not timed: nothing here asserts how long a run took."""

from __future__ import annotations

import pytest

from sparse_kv_lab.sim.soak import SoakPlan, SoakResult, run_soak, slope
from connector.transport.nixl import TransportConfig

pytestmark = pytest.mark.slow

PER_TRANSFER = ("connector.engine.sender_state.SendRequest", "connector.engine.sender_state.Destination",
                "connector.engine.sender_state.Parked", "connector.engine.batch_writer.BatchTimes",
                "connector.transport.nixl.poller.Xfer", "connector.engine.receiver._Pending",
                "connector.engine.receiver.ReceiveResult", "_asyncio.Task", "concurrent.futures._base.Future")
"""Live objects a transfer makes: at the end of a sample interval (no transfer in flight) no more than at the
baseline."""
RELEASED_MAX_IDS = 256
"""Prefill remembers this many released ids (instead of 65536), so a run of 2,000 requests passes the bound many
times over: what is kept per released id must be bounded by it too."""
RSS_BYTES_PER_REQUEST = 2048
"""Bound on the least-squares slope of RSS over the samples after the warm-up, per request. Leak-free code measures
about 0-600 B per request here over 1,500 requests (glibc's heap and the allocator's pools still settling: a single
128 KiB-1 MiB step in RSS is 100-700 B per request over such a run). A leak of 4 KB per request would show as a slope
of about 4,096 and fail; one of a few hundred bytes per request (a small dict entry kept per transfer) does not show
in RSS over so short a run, so the tables and object counts are asserted exactly instead."""
FDS_SLACK, THREADS_SLACK, TASKS_SLACK = 3, 1, 2
UCX_SOCKETS_PER_RELOAD = 1 + TransportConfig.__dataclass_fields__["nixl_threads"].default
"""Sockets NIXL 1.5.1 leaves open on each side each time prefill unloads a decode agent (remove_remote_agent) and
loads it, or a new one, again (prefill now keeps agents loaded across reconnects, connector.engine.agents, so only a
restart under a new agent name loads one): one per UCX worker (NIXL's own plus `nixl_threads`). Measured with two bare
Transports in one process: 2, 4 and 10 more sockets per add_peer + WRITE + remove_peer cycle with nixl_threads 0, 1
and 4, still there seconds later. Decode gets its back when its agent closes (a restart); prefill never does while
it runs. Outside this code (NIXL closes its endpoints with ucp_ep_close_nbx in flush mode and frees the request):
bounded here so that a leak of our own on top fails, and reported as an expected failure until NIXL closes them."""


UCX_RSS_BYTES_PER_RELOAD = 256 << 10
"""RSS each such reload may add on top (what NIXL keeps of the endpoints it does not close): measured about 50 KB per
reload on prefill (2.4 KB per request with a reload every 20), while Python's object count stayed flat."""
GC_OBJECTS_SLACK = 500
"""Live Python objects more than at the baseline allowed at the end (caches and the allocator's own settle; measured
tens to a few hundred): 2,000 requests leaving one object each behind would fail."""


def sockets(sample: dict) -> int:
    return sample["fd_kinds"].get("socket", 0)


def check(result: SoakResult, reloads: int = 0, rss_sides: tuple[str, ...] = ("prefill", "decode")) -> int:
    """Assert the soak left nothing growing; `reloads`: decode agents prefill unloaded and loaded again since the
    baseline; `rss_sides`: the processes whose RSS is bounded. Returns the most sockets either side has more than at
    its baseline (NIXL's, see above)."""
    plan = result.plan
    assert result.failures == 0, result.done
    assert {side: d["requests"] for side, d in result.done.items()} == {"prefill": plan.requests,
                                                                         "decode": plan.requests}
    most_sockets = 0
    for side in ("prefill", "decode"):
        samples = [s for s in result.side(side) if s["requests"] >= plan.warmup]
        assert len(samples) >= 3, f"{side}: too few samples after the warm-up to judge growth"
        first, last = samples[0], samples[-1]
        for name in PER_TRANSFER:
            assert last["types"][name] <= first["types"][name], (side, name, first["types"], last["types"])
        extra_sockets = sockets(last) - sockets(first)
        assert extra_sockets <= UCX_SOCKETS_PER_RELOAD * reloads + FDS_SLACK, (side, first["fd_kinds"],
                                                                             last["fd_kinds"])
        most_sockets = max(most_sockets, extra_sockets)
        assert last["fds"] - extra_sockets <= first["fds"] + FDS_SLACK, (side, first["fd_kinds"], last["fd_kinds"])
        assert last["threads"] <= first["threads"] + THREADS_SLACK, (side, first["threads"], last["threads"])
        assert last["tables"]["tasks"] <= first["tables"]["tasks"] + TASKS_SLACK, (side, first["tables"],
                                                                                   last["tables"])
        rss_slope = slope([(s["requests"], s["rss_bytes"]) for s in samples])
        span = last["requests"] - first["requests"]
        bound = RSS_BYTES_PER_REQUEST + UCX_RSS_BYTES_PER_RELOAD * reloads / span
        if side in rss_sides:
            assert rss_slope < bound, (side, rss_slope, bound, [s["rss_bytes"] for s in samples])
        # Python's own objects: what a leak of ours would add to, whatever RSS does
        assert last["gc_objects"] - first["gc_objects"] < GC_OBJECTS_SLACK, (side, last.get("grown"))
    prefill = result.side("prefill")[-1]["tables"]
    assert prefill["requests"] == prefill["parked"] == prefill["inbox"] == prefill["timeline"] == 0, prefill
    assert prefill["streaming"] == 0, prefill
    assert prefill["xfer_handles"] == prefill["inflight_bytes"] == 0, prefill
    assert prefill["connections"] <= 1 and prefill["peers"] <= 1 and prefill["nixl_peers"] <= 1, prefill
    assert prefill["released_ids"] <= plan.released_max_ids, prefill
    # what is kept per released id (how it ended) goes with the id, also when the bound pushes the oldest out
    finished = result.side("prefill")[-1]["types"]["connector.engine.sender_state.FinishedInfo"]
    assert finished <= plan.released_max_ids, (finished, prefill)
    decode = result.side("decode")[-1]["tables"]
    assert decode["pending"] == decode["confirming"] == 0 and decode["sources"] <= 1, decode
    return most_sockets


def test_requests_over_one_connection_leave_nothing_growing():
    result = run_soak(SoakPlan(requests=2000, sample_every=250, warmup=500, released_max_ids=RELEASED_MAX_IDS))
    assert check(result) <= FDS_SLACK  # no agent reloaded: no socket left behind either
    assert result.side("prefill")[-1]["tables"]["connections"] == 1  # one connection for the whole run


def test_decode_peer_churn_leaves_nothing_growing():
    """Every 20 requests the decode rank drops its connection; every third time it restarts instead (a new NIXL
    agent under a new name): prefill loads and unloads a peer agent each time. Samples come just before a restart,
    so each is at the same point of the cycle. Decode's RSS is not bounded here: a restart builds its whole rank
    again inside the same process (cache tensors, a NIXL agent and its UCX context), which adds 1-3 MB each of the
    first few times while the allocator settles (tools/soak.py --churn 10000: +16.9 MB over 49 restarts, flattening
    out); its object counts, fds and threads are, and prefill's RSS is."""
    result = run_soak(SoakPlan(requests=300, churn_every=20, restart_every=3, sample_every=60, warmup=60,
                               released_max_ids=RELEASED_MAX_IDS // 8))  # full (steady) by the baseline
    decode = result.side("decode")
    assert (decode[-1]["churns"], decode[-1]["restarts"]) == (14, 4)
    baseline = next(s for s in decode if s["requests"] >= result.plan.warmup)
    # a reconnect finds its agent still loaded (connector.engine.agents): only a restart loads one, and the
    # restarted rank's old agent stays loaded, idle, within max_peer_agents
    restarts = decode[-1]["restarts"] - baseline["restarts"]
    assert result.side("prefill")[-1]["tables"]["nixl_loaded"] <= 1 + decode[-1]["restarts"]
    extra_sockets = check(result, reloads=restarts, rss_sides=("prefill",))
    if extra_sockets > FDS_SLACK:  # everything else passed: what is left is NIXL's (UCX_SOCKETS_PER_RELOAD)
        pytest.xfail(f"NIXL 1.5.1 keeps {UCX_SOCKETS_PER_RELOAD} sockets per decode agent loaded (the restarted "
                     f"ranks' idle ones included, until unloaded; and leaks them on unload): {extra_sockets} more "
                     f"than at the baseline after {restarts} restarts")
