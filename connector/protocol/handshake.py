"""Checks on a peer's Hello before it is accepted: protocol version, role, model fingerprint and nonce
(`check_hello`, when the connection opens; the proofs are connector.protocol.auth); `check_peer_layout`: sizes that
can be this model's, before any plan is built; then `accept_peer`: its block size, the transfer plan between the two
sides, for a decode rank a region table that is exactly what the plan says that rank holds, and where the two sides'
block sizes differ, the views that cut the larger blocks (connector.core.block_views). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from connector.core.block_views import PairViews, pair_views, pool_block_sizes
from connector.core.errors import ControlError, LayoutError
from connector.core.describe import layout_difference
from connector.core.layout import POOLS, ModelLayout, ParallelLayout, PoolSpec, RankLayout, Region, check_tp
from connector.core.plan import TransferPlan, build_plan
from connector.protocol.auth import MEMORY_FIELDS, check_nonce, engine_name
from connector.protocol.messages import PROTOCOL_VERSION, Hello, PoolLayout

PeerKey = tuple[str, int, int]
"""(engine, pp, tp): a peer rank, told apart from the same rank of another engine. The engine is its id, with its
engine key's fingerprint when it has one (connector.protocol.auth.engine_name)."""


def peer_key(hello: Hello) -> PeerKey:
    return (engine_name(hello), hello.pp_rank, hello.tp_rank)


@dataclass(frozen=True)
class AcceptedPeer:
    """A peer rank whose Hello passed `accept_peer`."""

    hello: Hello
    plan: TransferPlan
    """The plan between the peer's engine and ours."""
    regions: dict[tuple[str, int], Region]
    """The peer's regions by (pool, global layer)."""
    views: PairViews | None = None
    """Where the two sides' block sizes differ: both sides' regions in blocks of the smaller size
    (connector.core.block_views); None: the regions move as they are."""

    @property
    def key(self) -> PeerKey:
        return peer_key(self.hello)

    @property
    def device_id(self) -> int:
        """Device index of the peer's KV caches (0 on CPU)."""
        return self.hello.regions[0].device_id if self.hello.regions else 0


def accept_peer(peer: Hello, own: Hello, model: ModelLayout, plan: TransferPlan | None = None) -> AcceptedPeer:
    """Check a peer rank's Hello against this rank's `own` before a byte moves: block sizes that can pair, the plan
    between the two layouts (built here from both Hellos unless `plan`, already built for the same pair of layouts,
    is given: the engines pass one from their plan cache, built off the event loop), and for a decode rank a region
    table holding exactly the layers and heads the plan gives it (a prefill rank sends no regions: decode never
    addresses prefill's memory). Raises LayoutError naming the first mismatch."""
    who = f"{peer.role} rank ({peer.pp_rank},{peer.tp_rank}) of engine {peer.engine_id}"
    if plan is None:
        plan = plan_between(peer, own, model)
    regions = check_peer_regions(peer, plan, peer.role) if peer.role == "decode" else {}
    return AcceptedPeer(peer, plan, regions, views_between(peer, own, model, regions, who))


def block_sizes_of(hello: Hello, model: ModelLayout) -> dict[str, int]:
    """Tokens per block of each paged pool of a rank: from its regions where it sent them (what is addressed),
    else from what its Hello declares (a prefill rank sends no regions). Raises LayoutError for a pool the model
    does not have or one with two sizes."""
    if hello.regions:
        return pool_block_sizes(hello.regions, hello.block_size)
    sizes = dict(hello.pool_block_sizes)
    unknown = sorted(set(sizes) - set(model.pools))
    if unknown:
        raise LayoutError(f"{hello.role} {hello.engine_id} declares block sizes for pools {unknown[:8]} that the "
                          f"model does not have: the model configs differ")
    if len(sizes) != len(hello.pool_block_sizes):
        raise LayoutError(f"{hello.role} {hello.engine_id} declares a block size twice for one pool: a broken peer")
    return sizes


def views_between(peer: Hello, own: Hello, model: ModelLayout, peer_regions: dict[tuple[str, int], Region],
                  who: str) -> PairViews | None:
    """Both sides' regions in blocks of the smaller size where their block sizes differ (None where none does)."""
    theirs, mine = block_sizes_of(peer, model), block_sizes_of(own, model)
    if peer.role == "decode":  # this side is prefill: it holds both sides' regions
        src, dst = {r.key: r for r in own.regions}, peer_regions
        sizes, units, nulls = (mine, theirs), (own.block_size, peer.block_size), (own.null_block, peer.null_block)
    else:
        src, dst = {}, {r.key: r for r in own.regions}
        sizes, units, nulls = (theirs, mine), (peer.block_size, own.block_size), (peer.null_block, own.null_block)
    return pair_views(src, dst, *sizes, units, model.pools, nulls, who)


def plan_between(peer: Hello, own: Hello, model: ModelLayout) -> TransferPlan:
    """The plan between the two engines, from both Hellos (CPU-heavy for large layouts: run it off the loop)."""
    theirs, mine = layout_of(peer, model), layout_of(own, model)
    return build_plan(model, theirs, mine) if peer.role == "prefill" else build_plan(model, mine, theirs)


def layout_key(hello: Hello) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """What a plan depends on besides the model: the peer engine's tp size and stages (every rank of one engine
    shares it, so a plan is built once per engine layout)."""
    return (hello.tp_size, hello.pp_size, tuple(tuple(s) for s in hello.stages))


def check_peer_layout(peer: Hello, own: Hello, model: ModelLayout, max_peer_ranks: int) -> None:
    """Refuse sizes that cannot be this model's, or that exceed `max_peer_ranks`, before any plan is built (a plan
    costs time in proportion to the peer's ranks). Raises LayoutError naming the field and the limit."""
    who = f"{peer.role} {peer.engine_id} rank ({peer.pp_rank},{peer.tp_rank})"
    if not peer.block_size:
        raise LayoutError(f"{who} claims a block size of 0 tokens")
    if not 1 <= peer.pp_size <= model.num_layers:
        raise LayoutError(f"{who} claims pp_size={peer.pp_size}; this model has {model.num_layers} layers")
    if not 1 <= peer.tp_size or peer.tp_size * peer.pp_size > max_peer_ranks:
        raise LayoutError(f"{who} claims tp_size={peer.tp_size} x pp_size={peer.pp_size} ranks; this side accepts at "
                          f"most {max_peer_ranks} (setting limits.max_peer_ranks)")
    if peer.pp_rank >= peer.pp_size or peer.tp_rank >= peer.tp_size:
        raise LayoutError(f"{who} is outside its own layout (pp_size={peer.pp_size}, tp_size={peer.tp_size})")
    for pool in model.pools.values():
        if pool.layers:
            check_tp(pool, peer.tp_size)
    layout_of(peer, model)  # stages: one per PP rank, contiguous, covering the model


def check_no_memory(hello: Hello, who: str) -> None:
    """A Hello on the wire carries no memory (protocol 2): decode sends its memory in Auth, prefill never."""
    sent = [name for name in MEMORY_FIELDS if getattr(hello, name)]
    if sent:
        raise ControlError(f"{who}'s Hello carries {sent}: protocol {PROTOCOL_VERSION} sends memory only in Auth, "
                           f"after the handshake is authenticated")


def layout_of(hello: Hello, model: ModelLayout) -> ParallelLayout:
    """The peer's ParallelLayout from its Hello (tp size and PP stage ranges)."""
    counts = [end - start for start, end in hello.stages]
    if len(counts) != hello.pp_size:
        raise LayoutError(f"{hello.role} {hello.engine_id} rank ({hello.pp_rank},{hello.tp_rank}) sent "
                          f"{len(counts)} stages for pp={hello.pp_size}: peers run different versions")
    return ParallelLayout.build(model.num_layers, hello.tp_size, hello.pp_size, counts)


def check_peer_regions(hello: Hello, plan: TransferPlan, side: str) -> dict[tuple[str, int], Region]:
    """Regions by (pool, layer), after checking they are exactly the layers and heads the peer's rank holds."""
    lay: RankLayout = plan.rank_layout(side, (hello.pp_rank, hello.tp_rank))
    who = f"{side} rank ({hello.pp_rank},{hello.tp_rank})"
    regions = {r.key: r for r in hello.regions}
    for pool in plan.model.pool_names:
        want = set(lay.layers(pool))
        have = {layer for p, layer in regions if p == pool}
        if have - want:
            raise LayoutError(f"{who} has {pool} for layers {sorted(have - want)} that its layout does not hold "
                              f"(stage {lay.stage[0]}-{lay.stage[1] - 1}): the model configs differ")
        if want - have:
            raise LayoutError(f"{who} has no {pool} for layers {sorted(want - have)} that its layout holds: "
                              f"the model configs differ")
        for layer in want:
            if regions[(pool, layer)].is_view:
                raise LayoutError(f"{who} sent {pool} layer {layer} as a view in sub-blocks: views are local only")
            if regions[(pool, layer)].heads != lay.heads(pool):
                raise LayoutError(f"{who} holds heads {regions[(pool, layer)].heads} of {pool} layer {layer}, "
                                  f"expected {lay.heads(pool)} for tp={plan.rank_layout(side, (0, 0)).parallel.tp}")
    return regions


def check_opening(peer: Hello, own: Hello) -> None:
    """Raise ControlError naming the first incompatibility of a peer's first Hello that does not depend on the model:
    protocol version, nonce, no memory, the other role. (A decode's opening is checked no further before prefill
    answers: decode compares the models itself, and tells the prefill that holds its transfer.)"""
    if peer.version != PROTOCOL_VERSION:
        raise ControlError(f"peer speaks protocol version {peer.version}, this side speaks {PROTOCOL_VERSION}: run "
                           f"the same sparse-kv-connector version on prefill and decode")
    check_nonce(peer, f"{peer.role} {peer.engine_id}")
    check_no_memory(peer, f"{peer.role} {peer.engine_id}")
    if peer.role == own.role:
        raise ControlError(f"peer role {peer.role!r} cannot talk to a {own.role!r} side; the two roles must differ")


def check_hello(peer: Hello, own: Hello) -> None:
    """Raise ControlError naming the first incompatibility between `peer`'s Hello as it came off the wire and this
    side's `own` Hello (the proofs are checked in connector.protocol.auth)."""
    check_opening(peer, own)
    if peer.fingerprint != own.fingerprint:
        what = [f"the two sides run models with different KV caches: {layout_mismatch(peer, own)}"]
        raise ControlError(f"model/layout fingerprint mismatch: peer has {peer.fingerprint}, this side has "
                           f"{own.fingerprint}: {'; '.join(what)}. Serve the same model (config.json, --dtype, "
                           f"--kv-cache-dtype, --block-size) on prefill and decode")


def layout_wire(model: ModelLayout) -> list[PoolLayout]:
    return [PoolLayout(p.name, list(p.layers), p.num_heads, p.bytes_per_token_per_head, p.num_parts, p.sharded,
                       p.block_size, p.bytes_per_block_per_head, p.per_request, p.same_tp, p.spec[:64])
            for p in (model.pools[name] for name in model.pool_names)]


def layout_of_hello(hello: Hello) -> ModelLayout | None:
    """The model layout a Hello describes (None when it carries none, or one that is not a layout)."""
    if not hello.layout:
        return None
    try:
        pools = {p.name: PoolSpec(p.name, tuple(p.layers), p.num_heads, p.bytes_per_token_per_head, p.num_parts,
                                  p.sharded, p.block_size, p.bytes_per_block_per_head, p.per_request, p.same_tp,
                                  p.spec) for p in hello.layout}
        return ModelLayout(name=hello.engine_id, num_layers=hello.num_layers, pools=pools)
    except LayoutError:
        return None


def layout_mismatch(peer: Hello, own: Hello) -> str:
    """What differs between the models of `peer` and `own`, in words (the fingerprints, when a layout is missing)."""
    theirs, mine = layout_of_hello(peer), layout_of_hello(own)
    if theirs is None or mine is None or theirs.fingerprint() != peer.fingerprint:
        return f"model fingerprints {peer.fingerprint} ({peer.role}) and {own.fingerprint} ({own.role})"
    return layout_difference(theirs, mine, me=f"{peer.role} {peer.engine_id}", them=f"{own.role} {own.engine_id}") \
        or f"model fingerprints {peer.fingerprint} ({peer.role}) and {own.fingerprint} ({own.role})"
