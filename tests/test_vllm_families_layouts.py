"""Every family of vLLM 0.33's model tree (tests.vllm_families: each family's own spec declarations for a tiny
config, planned by vLLM's real KV-cache planner and allocated as vLLM's worker allocates them) as SparseKVConnector
reads it: every cache of every KV-cache group gets a pool and a region on every rank, the plan covers every decode
rank's caches exactly once, or the pair is refused naming the cache, its spec and the reason. The table this prints
(`-s`) is what docs/compatibility.md's SparseKVConnector columns say."""

from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("vllm", reason="needs vllm==0.33.0")

from connector.core.errors import LayoutError  # noqa: E402
from connector.core.layout import ParallelLayout, RankLayout  # noqa: E402
from connector.core.plan import build_plan, check_plan  # noqa: E402
from connector.vllm.regions import build_regions  # noqa: E402
from connector.vllm.specs import ModelNames, assign_pools, model_from_caches, stage_caches  # noqa: E402
from tests import vllm_families as F  # noqa: E402

pytestmark = pytest.mark.vllm
PAIRS = [((1, 1), (1, 1)), ((2, 1), (1, 1)), ((1, 2), (1, 1)), ((1, 1), (2, 1)), ((2, 1), (2, 1))]
"""(prefill (tp, pp), decode (tp, pp))."""


def side(family: str, tp: int, pp: int):
    """The model layout every rank of one side builds, and each rank's regions: what register_kv_caches does."""
    per_rank = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            cfg, kvc = F.family_kv_cache_config(family, tp=tp, pp=pp, pp_rank=pp_rank, tp_rank=tp_rank)
            caches = stage_caches(kvc, F.family_kv_heads(family), frozenset(), F.family_num_layers(family),
                                  mla_model=bool(cfg.model_config.use_mla))
            per_rank[(pp_rank, tp_rank)] = (cfg, kvc, caches)
    models = {tp_rank: model_from_caches([c for r in range(pp) for c in per_rank[(r, tp_rank)][2]],
                                         F.family_num_layers(family), ModelNames(family, "bfloat16", "auto"))
              for tp_rank in range(tp)}
    assert len({m.fingerprint() for m in models.values()}) == 1, "TP ranks disagree on the model's caches"
    model = models[0]
    every = {c.name: c for c in assign_pools([c for r in range(pp) for c in per_rank[(r, 0)][2]])}
    parallel = ParallelLayout.build(model.num_layers, tp, pp, [hi - lo for lo, hi in
                                                              (F._stage_range(F._REGISTRY[family], pp, r)
                                                               for r in range(pp))]) \
        if model.num_layers == F.family_num_layers(family) else ParallelLayout.build(model.num_layers, tp, pp)
    regions = {}
    for (pp_rank, tp_rank), (cfg, kvc, caches) in per_rank.items():
        tensors = F.allocate((cfg, kvc))
        named = {c.name: msgspec.structs.replace(c, pool=every[c.name].pool) for c in caches}
        regions[(pp_rank, tp_rank)] = build_regions(tensors, named, kvc.num_blocks,
                                                    RankLayout(model, parallel, pp_rank, tp_rank))
        declared = {n for g in kvc.kv_cache_groups for n in g.layer_names}
        assert {c.name for c in caches} == declared  # every cache of every group, none left out
        assert len(regions[(pp_rank, tp_rank)]) == len(declared)
    return model, parallel, regions


@pytest.mark.parametrize("prefill, decode", PAIRS, ids=[f"P{p[0]}x{p[1]}-D{d[0]}x{d[1]}" for p, d in PAIRS])
@pytest.mark.parametrize("family", F.FAMILIES)
def test_every_family_moves_every_cache_or_is_refused_by_name(family, prefill, decode):
    try:
        p_model, p_par, _ = side(family, *prefill)
        d_model, d_par, _ = side(family, *decode)
    except LayoutError as exc:  # refused at start-up: must name a layer and its spec
        assert "KV-cache layer" in str(exc) and "Spec" in str(exc), exc
        pytest.skip(f"refused at start-up: {exc}")
    except NotImplementedError as exc:  # the family's own model code refuses the setting (no connector involved)
        pytest.skip(f"vLLM's model refuses it: {exc}")
    assert p_model.fingerprint() == d_model.fingerprint()
    tied = [p for p in p_model.pools.values() if p.layers and p.same_tp]
    if tied and prefill[0] != decode[0]:
        with pytest.raises(LayoutError, match="split over TP") as err:
            build_plan(p_model, p_par, d_par)
        assert tied[0].name in str(err.value) and tied[0].spec in str(err.value)
        return
    plan = build_plan(p_model, p_par, d_par)
    check_plan(plan)  # every decode rank's every (pool, layer, head) exactly once
    for rank in d_par.ranks():
        lay = plan.rank_layout("decode", rank)
        held = {(pool, layer) for pool in p_model.pool_names for layer in lay.layers(pool)}
        assert {(r.pool, r.layer) for r in plan.routes_to(rank)} == held
