"""The engines' small tables, as pure objects: the plan cache (connector.engine.plans.PlanCache) and the per-interval
stats reader (connector.engine.stats.StatsDelta). No NIXL, no sockets, no processes."""

from __future__ import annotations

import asyncio
import threading

import pytest

from connector.core.layout import ParallelLayout
from connector.engine import plans
from connector.engine.plans import PlanCache
from connector.engine.stats import SenderStats, StatsDelta, counter_names, series_names
from connector.transport.nixl.settings import WriteTiming
from tests.helpers import make_model, rank_hello

MODEL = make_model("ddkkvk" * 2)


def layout(tp: int, pp: int, counts: list[int] | None = None) -> ParallelLayout:
    return ParallelLayout.build(MODEL.num_layers, tp, pp, counts)


@pytest.fixture
def builds(monkeypatch):
    """Every plan PlanCache builds, with the thread it was built on."""
    made: list[tuple[tuple, int]] = []
    real = plans.plan_between

    def counted(peer, own, model):
        made.append(((peer.tp_size, peer.pp_size, tuple(tuple(s) for s in peer.stages)), threading.get_ident()))
        return real(peer, own, model)

    monkeypatch.setattr(plans, "plan_between", counted)
    return made


async def test_one_plan_per_peer_engine_layout_built_off_the_loop(builds):
    cache = PlanCache(MODEL, rank_hello(MODEL, "prefill", layout(1, 2)))
    two_ranks = [rank_hello(MODEL, "decode", layout(2, 1), (0, tp)) for tp in (0, 1)]
    first = await cache.plan_for(two_ranks[0])
    assert await cache.plan_for(two_ranks[1]) is first  # the same engine's next rank: no second build
    other = await cache.plan_for(rank_hello(MODEL, "decode", layout(1, 2, [5, 7])))
    assert other is not first and other.decode.stages == ((0, 5), (5, 12))
    assert [key for key, _ in builds] == [(2, 1, ((0, 12),)), (1, 2, ((0, 5), (5, 12)))]
    assert threading.get_ident() not in {thread for _, thread in builds}  # never on the event loop's thread
    assert first.routes_to((0, 1)) and first.routes_from((1, 0))  # the route indexes came built


async def test_a_burst_of_claims_builds_each_layout_once(builds):
    cache = PlanCache(MODEL, rank_hello(MODEL, "prefill", layout(1, 1)))
    hellos = [rank_hello(MODEL, "decode", layout(4, 1), (0, tp)) for tp in range(4)] * 3
    got = await asyncio.gather(*(cache.plan_for(h) for h in hellos))
    assert len({id(p) for p in got}) == 1 and len(builds) == 1


async def test_the_least_recently_used_layout_goes_first(builds):
    cache = PlanCache(MODEL, rank_hello(MODEL, "prefill", layout(1, 1)), max_plans=2)
    a, b, c = (rank_hello(MODEL, "decode", layout(tp, 1)) for tp in (1, 2, 4))
    plan_a = await cache.plan_for(a)
    await cache.plan_for(b)
    assert await cache.plan_for(a) is plan_a  # a used again: b is now the oldest
    await cache.plan_for(c)  # evicts b
    assert await cache.plan_for(a) is plan_a
    await cache.plan_for(b)
    assert [key[0] for key, _ in builds] == [1, 2, 4, 2]


async def test_decode_side_cache_keys_by_the_prefill_layout(builds):
    cache = PlanCache(MODEL, rank_hello(MODEL, "decode", layout(2, 1)))
    plan = await cache.plan_for(rank_hello(MODEL, "prefill", layout(1, 2)))
    assert (plan.prefill.tp, plan.prefill.pp, plan.decode.tp) == (1, 2, 2)


# ---- StatsDelta -----------------------------------------------------------------------------------------------
def test_counters_and_series_are_told_apart_by_type():
    counters, series = counter_names(SenderStats), series_names(SenderStats)
    assert {"bytes_sent", "bytes_sent_kv", "bytes_sent_index_k", "bytes_sent_index_v", "sends_expired"} <= \
        set(counters)
    assert series == ("post_seconds", "transfer_seconds", "compute_seconds", "exposed_seconds", "ack_seconds")
    assert not set(counters) & set(series)


@pytest.mark.parametrize("steps", [
    [dict(bytes_sent=10, writes=1), dict(), dict(bytes_sent=5, sends_ok=2)],
    [dict(), dict(descriptors=7)],
    [dict(kv=100, index_k=7), dict(index_v=3), dict(kv=1)],
    [{"kv": 10, "self_attn.swa_cache": 4}, {"self_attn.swa_cache": 2}],
])
def test_each_take_reports_what_each_counter_gained_since_the_last(steps):
    stats = SenderStats(bytes_sent=1000, writes=3)  # what came before the reader started does not count
    delta = StatsDelta(stats)
    for step in steps:
        for name, n in step.items():
            if name in ("kv", "index_k", "index_v") or "." in name:
                stats.add_pool_bytes(name, n)
            else:
                setattr(stats, name, getattr(stats, name) + n)
        counts, _ = delta.take()
        want = {name: 0 for name in counter_names(SenderStats)}
        by_cache = {}
        for name, n in step.items():
            if name in ("kv", "index_k", "index_v") or "." in name:
                by_cache[name] = n  # every pool, per cache
                if "." not in name:
                    want[f"bytes_sent_{name}"] = n  # the three first also under their own counter
            else:
                want[name] = n
        assert counts == {**want, "bytes_sent_by_cache": by_cache}


def test_samples_are_taken_out_once():
    stats = SenderStats()
    delta = StatsDelta(stats)
    stats.record_write(WriteTiming(post_s=0.001, transfer_s=0.004))
    stats.record_write(WriteTiming(post_s=0.002, transfer_s=0.005))
    _, samples = delta.take()
    assert samples == {"post_seconds": [0.001, 0.002], "transfer_seconds": [0.004, 0.005], "compute_seconds": [],
                       "exposed_seconds": [], "ack_seconds": []}
    assert not stats.post_seconds and not any(delta.take()[1].values())
