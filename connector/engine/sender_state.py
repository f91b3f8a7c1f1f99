"""State of the prefill-side sender, and the pure check of a decode registration. No I/O here."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

from connector.core.descriptors import check_blocks
from connector.core.errors import RegistrationError
from connector.core.layout import blocks_for
from connector.core.plan import Route
from connector.protocol.handshake import AcceptedPeer, PeerKey
from connector.protocol.messages import Register


@dataclass(frozen=True)
class PeerInfo:
    """An accepted decode rank (its Hello, the plan with this prefill layout, its regions) and the name its NIXL
    agent was loaded as."""

    accepted: AcceptedPeer
    agent: str


@dataclass
class Destination:
    """One decode rank's view of one request."""

    key: PeerKey
    conn: Any
    """The ControlConnection to that decode rank."""
    peer: PeerInfo
    layer_routes: dict[int, list[Route]]
    register: Register
    sent_tokens: dict[int, int] = field(default_factory=dict)
    writing: set[int] = field(default_factory=set)
    """Layers in a write now."""
    batches_in_flight: int = 0
    notice: Any = None
    """Abort or Stopped to send once no WRITE to this destination is in flight any more."""
    bytes_written: int = 0
    descriptors: int = 0
    staged_chunks: int = 0
    done: bool = False


@dataclass
class SendRequest:
    transfer_id: str
    num_tokens: int
    block_ids: list[list[int]]
    computed_tokens: int = 0
    ready_tokens: dict[int, int] = field(default_factory=dict)
    final: bool = False
    dests: dict[PeerKey, Destination] = field(default_factory=dict)
    expected: set[PeerKey] | None = None
    lease_deadline: float = math.inf
    failed: bool = False
    generation: int = 0
    """Bumped when prefill restarts the request (vLLM preemption): WRITEs of an older generation do not count."""
    first_write_at: float = 0.0
    """Wall-clock time (time.time()) the first WRITE of this request was posted; 0 = none yet."""
    finished: asyncio.Future | None = None


@dataclass(frozen=True)
class FinishedInfo:
    ok: bool
    """Every decode rank completed (False: aborted, failed or lease expired; blocks are free either way)."""
    first_write_at: float
    """Wall-clock time (time.time()) of the first WRITE; 0 = none was posted."""


def validate_registration(req: SendRequest | None, reg: Register, key: PeerKey, peer: AcceptedPeer | None,
                          rank: tuple[int, int], stage: tuple[int, int], block_size: int) -> dict[int, list[Route]]:
    """Check a decode registration before anything is written; returns the routes per global layer this prefill
    rank sends that decode rank (possibly none). Raises RegistrationError / DescriptorError naming the problem."""
    tid = reg.transfer_id
    if req is None:
        raise RegistrationError(f"transfer id {tid!r} is unknown on prefill rank {rank}: it already "
                                f"finished, expired or was aborted")
    if (reg.dst_pp, reg.dst_tp) != key[1:]:
        raise RegistrationError(f"registration names decode rank ({reg.dst_pp},{reg.dst_tp}) but arrived on "
                                f"the connection of rank {key[1:]}")
    if key in req.dests:
        raise RegistrationError(f"decode rank {key} registered {tid!r} twice")
    if peer is None:
        raise RegistrationError(f"decode rank {key} has no accepted handshake")
    if not 0 < reg.num_tokens <= req.num_tokens:
        raise RegistrationError(f"{tid!r} has {req.num_tokens} prompt tokens on prefill but decode asks for "
                                f"{reg.num_tokens}: the proxy sent different prompts")
    if not (0 <= reg.first_token <= reg.num_tokens) or reg.first_token % block_size:
        raise RegistrationError(f"first_token {reg.first_token} must be a multiple of the block size "
                                f"{block_size} within 0..{reg.num_tokens}")
    # Every decode rank registers with every prefill rank, also where the plan routes nothing between them
    # (e.g. replicated MLA pools come from one prefill TP rank): such a rank completes at once, so it never
    # holds its blocks waiting for a registration that would not come.
    layer_routes = peer.plan.layer_routes(rank, key[1:])
    routes = [r for rs in layer_routes.values() for r in rs]
    foreign = sorted(set(reg.layers) - set(layer_routes))
    if foreign:
        raise RegistrationError(f"registration of {tid!r} asks prefill rank {rank} (layers {stage[0]}-{stage[1] - 1}) "
                                f"for layers {foreign} it does not send to decode rank {key[1:]}: "
                                f"the two sides disagree on the layer split")
    blocks_needed = blocks_for(reg.num_tokens, block_size)
    for g in sorted({peer.regions[(r.pool, r.layer)].group for r in routes}):
        if g >= len(reg.block_ids):
            raise RegistrationError(f"registration of {tid!r} has {len(reg.block_ids)} block-id group(s) but "
                                    f"decode regions use group {g}")
        ids = reg.block_ids[g]
        if len(ids) < blocks_needed:
            raise RegistrationError(f"group {g} has {len(ids)} block ids for {reg.num_tokens} tokens, needs "
                                    f"{blocks_needed}")
        if len(set(ids[:blocks_needed])) != blocks_needed:
            raise RegistrationError(f"group {g} block ids repeat: each token block needs its own block")
    for r in routes:  # every destination block inside its region (raises DescriptorError naming them)
        region = peer.regions[(r.pool, r.layer)]
        check_blocks(region, reg.block_ids[region.group][:blocks_needed], f"decode {r.pool} layer {r.layer} ")
    return layer_routes


def lease_expiry_note(req: SendRequest, lease_s: float) -> str:
    """What prefill logs when a request's lease runs out: its KV is freed, read by nobody or only by some."""
    if req.expected is None:
        return (f"transfer {req.transfer_id}: lease of {lease_s:.0f} s expired and no decode ever registered for it; "
                f"its KV is freed unread (did the router send the decode leg with prefill's kv_transfer_params?)")
    return (f"transfer {req.transfer_id}: lease of {lease_s:.0f} s expired; decode ranks {sorted(req.expected)} "
            f"never completed; freeing its blocks")


class RecentIds:
    """Transfer ids remembered for `keep_s` seconds (so a late message about one is answered clearly), then
    forgotten: a bounded memory of what happened, not a growing one."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._at: dict[str, float] = {}

    def add(self, transfer_id: str) -> None:
        self._at[transfer_id] = time.monotonic()

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._at

    def discard(self, transfer_id: str) -> bool:
        """Forget it now; True if it was there."""
        return self._at.pop(transfer_id, None) is not None

    def expire(self, now: float) -> list[str]:
        """Forget (and return) the ids older than `keep_s`."""
        old = [tid for tid, at in self._at.items() if now - at > self.keep_s]
        for tid in old:
            del self._at[tid]
        return old
