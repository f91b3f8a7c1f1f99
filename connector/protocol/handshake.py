"""Checks on a peer's Hello before it is accepted: protocol version, auth, role and model fingerprint
(`check_hello`, when the connection opens); then `accept_peer`: its parallel layout, its block size, the transfer plan
between the two sides, and a region table that is exactly what the plan says that rank holds. Pure."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from connector.core.errors import ControlError, LayoutError
from connector.core.layout import POOLS, ModelLayout, ParallelLayout, RankLayout, Region
from connector.core.plan import TransferPlan, build_plan
from connector.protocol.messages import PROTOCOL_VERSION, Hello

PeerKey = tuple[str, int, int]
"""(engine id, pp, tp): a peer rank, told apart from the same rank of another engine."""


def peer_key(hello: Hello) -> PeerKey:
    return (hello.engine_id, hello.pp_rank, hello.tp_rank)


@dataclass(frozen=True)
class AcceptedPeer:
    """A peer rank whose Hello passed `accept_peer`."""

    hello: Hello
    plan: TransferPlan
    """The plan between the peer's engine and ours."""
    regions: dict[tuple[str, int], Region]
    """The peer's regions by (pool, global layer)."""

    @property
    def key(self) -> PeerKey:
        return peer_key(self.hello)

    @property
    def device_id(self) -> int:
        """Device index of the peer's KV caches (0 on CPU)."""
        return self.hello.regions[0].device_id if self.hello.regions else 0


def accept_peer(peer: Hello, own: Hello, model: ModelLayout, plan: TransferPlan | None = None) -> AcceptedPeer:
    """Check a peer rank's Hello against this rank's `own` before a byte moves: the same block size, the plan
    between the two layouts (built here from both Hellos unless `plan`, already built for another rank of the same
    engine, is given), and a region table holding exactly the layers and heads the plan gives that rank. Raises
    LayoutError naming the first mismatch."""
    who = f"{peer.role} rank ({peer.pp_rank},{peer.tp_rank}) of engine {peer.engine_id}"
    if peer.block_size != own.block_size:
        raise LayoutError(f"{who} uses block size {peer.block_size}, this {own.role} rank {own.block_size}: start "
                          f"both sides with the same block size")
    if plan is None:
        theirs, mine = layout_of(peer, model), layout_of(own, model)
        plan = build_plan(model, theirs, mine) if peer.role == "prefill" else build_plan(model, mine, theirs)
    return AcceptedPeer(peer, plan, check_peer_regions(peer, plan, peer.role))


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
    for pool in POOLS:
        want = set(lay.layers(pool))
        have = {layer for p, layer in regions if p == pool}
        if have - want:
            raise LayoutError(f"{who} has {pool} for layers {sorted(have - want)} that its layout does not hold "
                              f"(stage {lay.stage[0]}-{lay.stage[1] - 1}): the model configs differ")
        if want - have:
            raise LayoutError(f"{who} has no {pool} for layers {sorted(want - have)} that its layout holds: "
                              f"the model configs differ")
        for layer in want:
            if regions[(pool, layer)].heads != lay.heads(pool):
                raise LayoutError(f"{who} holds heads {regions[(pool, layer)].heads} of {pool} layer {layer}, "
                                  f"expected {lay.heads(pool)} for tp={plan.rank_layout(side, (0, 0)).parallel.tp}")
    return regions


def check_hello(peer: Hello, own: Hello, auth_token: str = "") -> None:
    """Raise ControlError naming the first incompatibility between `peer` and this side's `own` Hello."""
    if peer.version != PROTOCOL_VERSION:
        raise ControlError(f"peer speaks protocol version {peer.version}, this side speaks {PROTOCOL_VERSION}")
    if auth_token and not hmac.compare_digest(peer.auth_token.encode(), auth_token.encode()):
        raise ControlError("bad auth token")
    if peer.role == own.role:
        raise ControlError(f"peer role {peer.role!r} cannot talk to a {own.role!r} side; the two roles must differ")
    if peer.fingerprint != own.fingerprint:
        raise ControlError(f"model/layout fingerprint mismatch: peer has {peer.fingerprint}, "
                           f"this side has {own.fingerprint}")
