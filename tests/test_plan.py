"""The transfer plan: property tests over random layer patterns, PP splits and TP pairs."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connector.core.errors import LayoutError
from connector.core.layout import POOLS, ParallelLayout, pp_partition
from connector.core.plan import build_plan, check_plan, fold_ranges, format_table
from tests.helpers import m3_like, make_model


def expected_heads(num_heads: int, sharded: bool, tp: int, rank: int) -> set[int]:
    """vLLM's rule, written out independently of layout.heads_of_rank."""
    if not sharded:
        return set(range(num_heads))
    if num_heads >= tp:
        per = num_heads // tp
        return set(range(rank * per, rank * per + per))
    return {rank * num_heads // tp}


@st.composite
def split(draw, num_layers: int, max_pp: int = 8):
    pp = draw(st.integers(1, min(max_pp, num_layers)))
    if draw(st.booleans()):
        return pp, None
    cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=pp - 1, max_size=pp - 1))) if pp > 1 else []
    bounds = [0, *cuts, num_layers]
    return pp, [b - a for a, b in zip(bounds, bounds[1:])]


@st.composite
def scenario(draw):
    kinds = draw(st.text(alphabet="dkv", min_size=1, max_size=40))
    mla = draw(st.booleans())
    kv_heads = draw(st.sampled_from([1, 2, 4, 8]))
    model = make_model(kinds, kv_heads=kv_heads, mla=mla)
    tps = [t for t in (1, 2, 4, 8) if mla or kv_heads % t == 0 or t % kv_heads == 0]
    sides = []
    for _ in range(2):
        pp, counts = draw(split(len(kinds)))
        sides.append(ParallelLayout.build(len(kinds), draw(st.sampled_from(tps)), pp, counts))
    return model, sides[0], sides[1]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_every_decode_byte_has_exactly_one_source_that_holds_it(case):
    model, prefill, decode = case
    plan = build_plan(model, prefill, decode)
    check_plan(plan)  # the runtime checker agrees with the independent checks below

    covered = Counter()
    for r in plan.routes:
        pool = model.pools[r.pool]
        # the source stage holds the layer, and its slot is the layer's position in that stage's compacted list
        s_start, s_end = prefill.stages[r.src.pp]
        assert s_start <= r.layer < s_end
        assert r.src.slot == sum(1 for lid in pool.layers if s_start <= lid < r.layer)
        d_start, d_end = decode.stages[r.dst.pp]
        assert d_start <= r.layer < d_end
        assert r.dst.slot == sum(1 for lid in pool.layers if d_start <= lid < r.layer)
        assert r.layer in pool.layers
        route_heads = set(range(*r.heads))
        assert route_heads <= expected_heads(pool.num_heads, pool.sharded, prefill.tp, r.src.tp)
        assert route_heads <= expected_heads(pool.num_heads, pool.sharded, decode.tp, r.dst.tp)
        assert r.bytes_per_token == len(route_heads) * pool.bytes_per_token_per_head
        for h in route_heads:
            covered[(r.dst.pp, r.dst.tp, r.pool, r.layer, h)] += 1

    wanted = Counter()
    for dpp, (start, end) in enumerate(decode.stages):
        for dtp in range(decode.tp):
            for name in POOLS:
                pool = model.pools[name]
                for lid in pool.layers:
                    if start <= lid < end:
                        for h in expected_heads(pool.num_heads, pool.sharded, decode.tp, dtp):
                            wanted[(dpp, dtp, name, lid, h)] += 1
    assert covered == wanted  # exactly once each, nothing extra

    # bytes: each decode rank receives exactly what it holds
    for dpp, (start, end) in enumerate(decode.stages):
        for dtp in range(decode.tp):
            got = sum(r.bytes_per_token for r in plan.routes_to((dpp, dtp)))
            want = sum(len(expected_heads(p.num_heads, p.sharded, decode.tp, dtp)) * p.bytes_per_token_per_head
                       for p in model.pools.values() for lid in p.layers if start <= lid < end)
            assert got == want


@settings(max_examples=100, deadline=None)
@given(scenario())
def test_replicated_pools_spread_over_prefill_tp_ranks(case):
    model, prefill, decode = case
    plan = build_plan(model, prefill, decode)
    for r in plan.routes:
        if not model.pools[r.pool].sharded:
            assert r.heads == (0, model.pools[r.pool].num_heads)
    if decode.tp >= prefill.tp and model.pools["index_k"].layers:
        senders = {r.src.tp for r in plan.routes if r.pool == "index_k"}
        assert senders == set(range(prefill.tp))


def test_worked_example_index_k_layer_30_goes_from_p_slot_0_to_d_slot_27():
    model = m3_like()
    plan = build_plan(model, ParallelLayout.build(60, 4, 2), ParallelLayout.build(60, 4, 1))
    check_plan(plan)
    assert plan.prefill.stages == ((0, 30), (30, 60))
    routes = [r for r in plan.routes if r.pool == "index_k" and r.layer == 30]
    assert len(routes) == 4  # one per decode TP rank
    for r in routes:
        assert (r.src.pp, r.src.slot, r.dst.pp, r.dst.slot) == (1, 0, 0, 27)
    kv = [r for r in plan.routes if r.pool == "kv" and r.layer == 30]
    assert sorted((r.src.tp, r.dst.tp, r.heads) for r in kv) == [(t, t, (t, t + 1)) for t in range(4)]
    assert all(r.src.slot == 0 and r.dst.slot == 30 for r in kv)


def test_tp4_to_tp2_kv_heads_come_from_two_prefill_ranks():
    model = m3_like()
    plan = build_plan(model, ParallelLayout.build(60, 4, 2), ParallelLayout.build(60, 2, 1))
    kv0 = [r for r in plan.routes if r.pool == "kv" and r.layer == 0 and r.dst.tp == 1]
    assert sorted((r.src.tp, r.heads) for r in kv0) == [(2, (2, 3)), (3, (3, 4))]
    assert plan.sources_of((0, 0)) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_more_tp_ranks_than_heads_replicate_one_head():
    model = make_model("dk" * 4, kv_heads=2)
    plan = build_plan(model, ParallelLayout.build(8, 8, 1), ParallelLayout.build(8, 4, 2))
    check_plan(plan)
    # decode tp4 with 2 heads: ranks 0,1 hold head 0; prefill tp8: ranks 0-3 hold head 0
    srcs = {r.dst.tp: r.src.tp for r in plan.routes if r.pool == "kv" and r.layer == 0}
    assert srcs[0] in range(4) and srcs[1] in range(4) and srcs[0] != srcs[1]


def test_vllm_default_partition():
    assert pp_partition(60, 2) == (30, 30)
    assert pp_partition(61, 2) == (31, 30)
    assert pp_partition(62, 4) == (15, 16, 16, 15)
    assert pp_partition(7, 4) == (2, 2, 2, 1)


def test_vllm_default_partition_matches_vllm_source():
    utils = pytest.importorskip("vllm.distributed.utils")
    for n in (7, 36, 60, 61, 62, 95):
        for pp in range(1, 9):
            if pp <= n:
                stages = ParallelLayout.build(n, 1, pp).stages
                assert stages == tuple(utils.get_pp_indices(n, r, pp) for r in range(pp)), (n, pp)


@pytest.mark.parametrize("counts, fix", [
    ([30, 31], "adds up to 61 but the model has 60 layers"),
    ([60], "has 1 stages but pp=2"),
    ([0, 60], "empty stage"),
])
def test_bad_split_names_the_value_and_fix(counts, fix):
    with pytest.raises(LayoutError, match=fix):
        ParallelLayout.build(60, 1, 2, counts)


def test_tp_neither_dividing_nor_multiple_of_heads_is_refused():
    model = make_model("dk", kv_heads=4)
    with pytest.raises(LayoutError, match="tp=3 neither divides nor is a multiple of the 4 KV heads"):
        build_plan(model, ParallelLayout.build(2, 3, 1), ParallelLayout.build(2, 1, 1))


def test_table_folds_ranges():
    model = m3_like()
    text = format_table(build_plan(model, ParallelLayout.build(60, 4, 2), ParallelLayout.build(60, 4, 1)))
    assert "index_k  layers 30-59: P(pp1,tp0) slots 0-29 -> D(pp0,tp0) slots 27-56" in text
    assert "index_k  layers 3-29: P(pp0,tp0) slots 0-26 -> D(pp0,tp0) slots 0-26" in text
    assert "kv       layers 30-59 heads 0: P(pp1,tp0) slots 0-29 -> D(pp0,tp0) slots 30-59" in text
    assert fold_ranges([3, 4, 5, 7, 9, 10]) == "3-5,7,9-10"
