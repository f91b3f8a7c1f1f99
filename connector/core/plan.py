"""Which prefill rank sends which (pool, global layer, heads) to which decode rank. Pure, no I/O.

Computed once per (prefill layout, decode layout) and then only looked up, like vLLM's nixl `tp_mapping.py`.
Every route is keyed by (pool, global layer); slots are each side's local addresses, derived from its own
compacted list (docs/commands.md, "The plan": index layer 30 is slot 0 on prefill stage 1 and slot 27 on decode).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable

from connector.core.errors import LayoutError, PlanError
from connector.core.layout import POOLS, ModelLayout, ParallelLayout, RankLayout, check_tp, heads_of_rank

Rank = tuple[int, int]
"""(pp, tp)."""


@dataclass(frozen=True)
class Endpoint:
    pp: int
    tp: int
    slot: int
    """Position of the layer in this rank's compacted list of the route's pool."""

    @property
    def rank(self) -> Rank:
        return (self.pp, self.tp)


@dataclass(frozen=True)
class Route:
    pool: str
    layer: int
    """Global layer id: the key. Never a list position."""
    src: Endpoint
    dst: Endpoint
    heads: tuple[int, int]
    """Global heads [first, end) this route carries; (0, num_heads) for replicated pools."""
    bytes_per_token: int
    """Bytes per prompt token this route moves."""


@dataclass(frozen=True)
class TransferPlan:
    model: ModelLayout
    prefill: ParallelLayout
    decode: ParallelLayout
    routes: tuple[Route, ...]

    def rank_layout(self, side: str, rank: Rank) -> RankLayout:
        parallel = self.prefill if side == "prefill" else self.decode
        return RankLayout(self.model, parallel, rank[0], rank[1])

    @cached_property
    def _by_src(self) -> dict[Rank, tuple[Route, ...]]:
        table: dict[Rank, list[Route]] = defaultdict(list)
        for route in self.routes:
            table[route.src.rank].append(route)
        return {rank: tuple(rs) for rank, rs in table.items()}

    @cached_property
    def _by_dst(self) -> dict[Rank, tuple[Route, ...]]:
        table: dict[Rank, list[Route]] = defaultdict(list)
        for route in self.routes:
            table[route.dst.rank].append(route)
        return {rank: tuple(rs) for rank, rs in table.items()}

    def routes_from(self, src: Rank) -> tuple[Route, ...]:
        return self._by_src.get(src, ())

    def routes_to(self, dst: Rank) -> tuple[Route, ...]:
        return self._by_dst.get(dst, ())

    def layer_routes(self, src: Rank, dst: Rank) -> dict[int, list[Route]]:
        """The routes prefill rank `src` sends decode rank `dst`, by global layer (empty when the plan routes
        nothing between them)."""
        out: dict[int, list[Route]] = defaultdict(list)
        for route in self.routes_from(src):
            if route.dst.rank == dst:
                out[route.layer].append(route)
        return dict(out)

    def sources_of(self, dst: Rank) -> list[Rank]:
        return sorted({r.src.rank for r in self.routes_to(dst)})

    def to_json(self) -> dict[str, Any]:
        return {
            "model": {
                "name": self.model.name,
                "num_layers": self.model.num_layers,
                "fingerprint": self.model.fingerprint(),
                "pools": {p: list(self.model.pools[p].layers) for p in self.model.pool_names},
            },
            "prefill": _parallel_json(self.prefill),
            "decode": _parallel_json(self.decode),
            "routes": [
                {
                    "pool": r.pool,
                    "layer": r.layer,
                    "src": {"pp": r.src.pp, "tp": r.src.tp, "slot": r.src.slot},
                    "dst": {"pp": r.dst.pp, "tp": r.dst.tp, "slot": r.dst.slot},
                    "heads": list(r.heads),
                    "bytes_per_token": r.bytes_per_token,
                }
                for r in self.routes
            ],
        }


def _parallel_json(p: ParallelLayout) -> dict[str, Any]:
    return {"tp": p.tp, "pp": p.pp, "stages": [list(s) for s in p.stages]}


def _pick(candidates: list[int], dst_tp: int) -> int:
    """Spread replicated sources over the prefill TP ranks that hold the data."""
    return candidates[dst_tp % len(candidates)]


def check_same_tp(model: ModelLayout, prefill_tp: int, decode_tp: int) -> None:
    """A cache whose TP split vLLM does not declare moves rank t to rank t only: refuse other pairs, naming it."""
    tied = [p for p in model.pools.values() if p.layers and p.same_tp]
    if tied and prefill_tp != decode_tp:
        names = ", ".join(f"{p.name} ({p.spec or 'cache'}, layers {fold_ranges(p.layers)})" for p in tied[:4])
        raise LayoutError(f"prefill runs tp={prefill_tp} and decode tp={decode_tp}, but vLLM's specs do not say how "
                          f"{names} split over TP (no max_tp_shards, not replicated): each TP rank's copy can only go "
                          f"to the same TP rank. Run prefill and decode with the same tensor-parallel size")


def build_plan(model: ModelLayout, prefill: ParallelLayout, decode: ParallelLayout) -> TransferPlan:
    for pool in model.pools.values():
        if pool.layers:
            check_tp(pool, prefill.tp)
            check_tp(pool, decode.tp)
    check_same_tp(model, prefill.tp, decode.tp)
    if prefill.stages[-1][1] != model.num_layers or decode.stages[-1][1] != model.num_layers:
        raise LayoutError(f"layouts cover {prefill.stages[-1][1]} / {decode.stages[-1][1]} layers but model "
                          f"{model.name} has {model.num_layers}: rebuild them from this model")
    routes: list[Route] = []
    for dst_pp, dst_tp in decode.ranks():
        dst_layout = RankLayout(model, decode, dst_pp, dst_tp)
        for pool_name in model.pool_names:
            pool = model.pools[pool_name]
            dst_heads = dst_layout.heads(pool_name)
            # same_tp: each rank's copy is its own, so it comes from the prefill rank of the same TP index
            sources = [(dst_tp, dst_heads)] if pool.same_tp else _sources_for_heads(pool, prefill.tp, dst_heads, dst_tp)
            for dst_slot, layer in enumerate(dst_layout.layers(pool_name)):
                src_pp = prefill.stage_of(layer)
                src_slot = RankLayout(model, prefill, src_pp, 0).slot(pool_name, layer)
                for src_tp, heads in sources:
                    routes.append(Route(
                        pool=pool_name, layer=layer,
                        src=Endpoint(src_pp, src_tp, src_slot), dst=Endpoint(dst_pp, dst_tp, dst_slot),
                        heads=heads, bytes_per_token=(heads[1] - heads[0]) * pool.bytes_per_token_per_head,
                    ))
    return TransferPlan(model=model, prefill=prefill, decode=decode, routes=tuple(routes))


def _sources_for_heads(pool, src_tp_size: int, dst_heads: tuple[int, int], dst_tp: int) -> list[tuple[int, tuple[int, int]]]:
    """[(src tp rank, head range)] covering `dst_heads` once, consecutive heads from one source folded."""
    holders: dict[int, list[int]] = defaultdict(list)
    for src_tp in range(src_tp_size):
        first, end = heads_of_rank(pool, src_tp_size, src_tp)
        for head in range(first, end):
            holders[head].append(src_tp)
    out: list[tuple[int, tuple[int, int]]] = []
    for head in range(*dst_heads):
        src_tp = _pick(holders[head], dst_tp)
        if out and out[-1][0] == src_tp and out[-1][1][1] == head:
            out[-1] = (src_tp, (out[-1][1][0], head + 1))
        else:
            out.append((src_tp, (head, head + 1)))
    return out


def check_plan(plan: TransferPlan) -> None:
    """Raise PlanError unless every (decode rank, pool, layer, head) is covered exactly once by a source that
    holds that layer and those heads, with both slots and bytes right."""
    model, problems = plan.model, []
    covered: dict[tuple[Rank, str, int, int], int] = defaultdict(int)
    for r in plan.routes:
        pool = model.pools[r.pool]
        src_l, dst_l = plan.rank_layout("prefill", r.src.rank), plan.rank_layout("decode", r.dst.rank)
        for side, lay, ep in (("src", src_l, r.src), ("dst", dst_l, r.dst)):
            held = lay.layers(r.pool)
            if r.layer not in held:
                problems.append(f"{side} {ep.rank} does not hold {r.pool} layer {r.layer}")
            elif held.index(r.layer) != ep.slot:
                problems.append(f"{side} {ep.rank} slot {ep.slot} for {r.pool} layer {r.layer}, "
                                f"expected {held.index(r.layer)}")
            first, end = lay.heads(r.pool)
            if not (first <= r.heads[0] < r.heads[1] <= end):
                problems.append(f"{side} {ep.rank} holds heads {first}-{end} of {r.pool}, route carries {r.heads}")
        if r.bytes_per_token != (r.heads[1] - r.heads[0]) * pool.bytes_per_token_per_head:
            problems.append(f"route {r} bytes_per_token wrong")
        for head in range(*r.heads):
            covered[(r.dst.rank, r.pool, r.layer, head)] += 1
    for rank in plan.decode.ranks():
        lay = plan.rank_layout("decode", rank)
        for pool in model.pool_names:
            for layer in lay.layers(pool):
                for head in range(*lay.heads(pool)):
                    n = covered.pop((rank, pool, layer, head), 0)
                    if n != 1:
                        problems.append(f"decode {rank} {pool} layer {layer} head {head} covered {n} times")
    problems += [f"route to {k} that decode does not hold" for k in covered]
    if problems:
        raise PlanError(f"{len(problems)} plan problems, first: " + "; ".join(problems[:5]))


def fold_ranges(values: Iterable[int]) -> str:
    """[3,4,5,7] -> '3-5,7'."""
    out, vals = [], sorted(values)
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        out.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ",".join(out)


def format_table(plan: TransferPlan) -> str:
    """Readable plan, grouped per decode rank, consecutive routes folded:
    `index_k layers 30-59: P(pp1,tp0) slots 0-29 -> D(pp0,tp0) slots 27-56`."""
    m = plan.model
    lines = [
        f"model {m.name}: {m.num_layers} layers, fingerprint {m.fingerprint()}",
        *(f"  {p:<8} {len(m.pools[p].layers):>3} layers {fold_ranges(m.pools[p].layers) or '-':<12} "
          f"{m.pools[p].bytes_per_token} B/token/layer, {m.pools[p].num_heads} head(s), "
          f"{_how(m.pools[p])}" for p in m.pool_names),
        f"prefill tp={plan.prefill.tp} pp={plan.prefill.pp} stages {_stages(plan.prefill)}",
        f"decode  tp={plan.decode.tp} pp={plan.decode.pp} stages {_stages(plan.decode)}",
    ]
    for rank in plan.decode.ranks():
        routes = plan.routes_to(rank)
        total = sum(r.bytes_per_token for r in routes)
        lines.append(f"D(pp{rank[0]},tp{rank[1]}): {len(routes)} routes from {len(plan.sources_of(rank))} "
                     f"source rank(s), {total} B per prompt token")
        for group in _fold(routes):
            first = group[0]
            heads = f" heads {fold_ranges(range(*first.heads))}" if m.pools[first.pool].sharded else ""
            lines.append(
                f"  {first.pool:<8} layers {fold_ranges(r.layer for r in group)}{heads}: "
                f"P(pp{first.src.pp},tp{first.src.tp}) slots {fold_ranges(r.src.slot for r in group)} -> "
                f"D(pp{first.dst.pp},tp{first.dst.tp}) slots {fold_ranges(r.dst.slot for r in group)}")
    return "\n".join(lines)


def _how(pool) -> str:
    how = "head-sharded" if pool.sharded else "same TP rank" if pool.same_tp else "replicated"
    return f"{how}, whole per request" if pool.per_request else how


def _stages(p: ParallelLayout) -> str:
    return " ".join(f"{s}-{e - 1}" for s, e in p.stages)


def _fold(routes: Iterable[Route]) -> list[list[Route]]:
    """Group routes (already in pool, slot order per rank) that continue each other."""
    groups: list[list[Route]] = []
    order = {pool: (POOLS.index(pool) if pool in POOLS else len(POOLS), pool) for pool in {r.pool for r in routes}}
    for r in sorted(routes, key=lambda r: (order[r.pool], r.src.rank, r.heads, r.dst.slot)):
        if groups:
            last = groups[-1][-1]
            if (last.pool, last.src.rank, last.heads) == (r.pool, r.src.rank, r.heads) \
                    and r.src.slot == last.src.slot + 1 and r.dst.slot == last.dst.slot + 1:
                groups[-1].append(r)
                continue
        groups.append([r])
    return groups
