"""State of the prefill-side sender, and the pure check of a decode registration. No I/O here."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from connector.core.descriptors import check_blocks, group_range
from connector.core.errors import RegistrationError
from connector.core.layout import Region, blocks_for
from connector.core.plan import Route
from connector.engine.peers import PeerInfo
from connector.engine.timeline import SendPoints
from connector.protocol.handshake import PeerKey
from connector.protocol.messages import Register

__all__ = ["Destination", "FinishedInfo", "Parked", "PeerInfo", "RecentIds", "SendRequest", "check_registration",
           "check_against_request", "given_up_note", "lease_expiry_note", "parked_cost"]


@dataclass
class Destination:
    """One decode rank's view of one request."""

    key: PeerKey
    conn: Any
    """The ControlConnection to that decode rank: WRITEs go to the agent loaded for it (`peer`), nowhere else."""
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
    bytes_by_pool: dict[str, int] = field(default_factory=dict)
    descriptors: int = 0
    staged_chunks: int = 0
    done: bool = False
    by_layer: Any = None
    """(span key, the request's block-id lists, LayerDescriptors): this chunk's descriptors for every layer, built
    with the first batch (connector.engine.batch_writer)."""
    expanded: Any = None
    """Where the two sides' block sizes differ: (the request's block-id lists, prefill's and decode's ids in
    sub-blocks) (connector.engine.batch_writer.BatchWriter.pair)."""


@dataclass
class SendRequest:
    transfer_id: str
    num_tokens: int
    block_ids: list[list[int]]
    computed_tokens: int = 0
    ready_tokens: dict[int, int] = field(default_factory=dict)
    all_computed: bool = False
    """Nothing more will become ready: prefill computed every token (the last chunk's sweep ran; the lease runs from
    then, `lease_deadline`), or aborted the request."""
    dests: dict[PeerKey, Destination] = field(default_factory=dict)
    expected: set[PeerKey] | None = None
    lease_deadline: float = math.inf
    failed: bool = False
    generation: int = 0
    """Bumped when prefill restarts the request (vLLM preemption): WRITEs of an older generation do not count."""
    first_write_at: float = 0.0
    """Wall-clock time (time.time()) the first WRITE of this request was posted; 0 = none yet."""
    points: SendPoints = field(default_factory=SendPoints)
    """Its timeline on this rank (connector.engine.timeline)."""
    loop_cpu_ns: int = 0
    """The event loop thread's CPU clock (time.thread_time_ns) when the request started, then what the loop used
    from then until every token was computed: the connector's Python that competed with the forward for the GIL
    (its timeline line says it as `loop_cpu_ms`)."""
    finished: asyncio.Future | None = None
    """Resolves to True/False once the request is released (every decode rank completed / some failed, or it was
    aborted or expired): its blocks are free then."""
    owner: str | None = None
    """The decode engine this transfer belongs to: the first to register it. Registrations from other engines are
    refused, their aborts and heartbeats change nothing."""
    given_up_by: str | None = None
    """A decode engine that aborted the transfer before any registration: the request keeps its KV only
    `given_up_keep_s` after it was computed (not the lease), for a registration from another engine (an unrelated
    peer's abort must not deny a transfer)."""
    given_up_why: str = ""
    """Why, when the give-up came from a refused handshake rather than an abort (what prefill logs as it frees the
    KV)."""
    secret: str = ""
    """The transfer's capability (`transfer_secret` of its kv_transfer_params, or minted by prefill's scheduler in
    the sequential flow): only a registration that proves it is served. '' = an open transfer (a router that named
    the transfer id but gave no secret): the first decode engine to register owns it."""


@dataclass(eq=False)
class Parked:
    """A registration that arrived before prefill started its request (checked already, except against the
    request itself). Its block ids came packed (4 bytes each, protocol 6) and wait so; its layers wait as an
    array. As the lists msgspec used to decode they cost ~40 bytes per id, and a peer parking hundreds of
    thousands left glibc and pymalloc holding tens of MB after it left, more after each time (issue 20).
    `register` gives the registration back whole."""

    conn: Any
    peer: PeerInfo
    stripped: Register
    """The registration with no layers (those are below)."""
    layers: np.ndarray
    at: float
    """time.monotonic() it arrived (it waits at most the lease)."""

    @classmethod
    def of(cls, conn: Any, peer: PeerInfo, reg: Register, at: float) -> "Parked":
        return cls(conn, peer, msgspec.structs.replace(reg, layers=[]), _compact(reg.layers), at)

    @property
    def register(self) -> Register:
        return msgspec.structs.replace(self.stripped, layers=self.layers.tolist())

    @property
    def cost(self) -> int:
        """Bytes it holds (what max_parked_bytes and max_parked_bytes_per_connection count)."""
        return parked_cost(self.stripped) + self.layers.nbytes


def _compact(ids: list[int]) -> np.ndarray:
    arr = np.array(ids, dtype=np.int64)
    return arr.astype(np.int32) if arr.size and 0 <= arr.min() and arr.max() < 2**31 else arr


@dataclass(frozen=True)
class FinishedInfo:
    ok: bool
    """Every decode rank completed (False: aborted, failed or lease expired; blocks are free either way)."""
    first_write_at: float
    """Wall-clock time (time.time()) of the first WRITE; 0 = none was posted."""


def check_against_request(req: SendRequest | None, reg: Register, key: PeerKey, rank: tuple[int, int],
                          states: tuple[int, str] | None = None) -> None:
    """The checks that need prefill's request: it exists, this rank has not registered yet, the prompt fits, and
    the per-request states this decode rank gets (`states`: the fewest tokens any may overshoot decode's resume
    point by, and its pool; None: it gets none) are taken where decode resumes."""
    tid = reg.transfer_id
    if req is None:
        raise RegistrationError(f"transfer id {tid!r} is unknown on prefill rank {rank}: it already "
                                f"finished, expired or was aborted")
    if key in req.dests:
        raise RegistrationError(f"decode rank {key} registered {tid!r} twice")
    if not 0 < reg.num_tokens <= req.num_tokens:
        raise RegistrationError(f"{tid!r} has {req.num_tokens} prompt tokens on prefill but decode asks for "
                                f"{reg.num_tokens}: the proxy sent different prompts")
    if states is not None and req.num_tokens - reg.num_tokens > states[0]:
        raise RegistrationError(
            f"{tid!r}: decode resumes at token {reg.num_tokens} but prefill's {states[1]} will hold the state after "
            f"{req.num_tokens} tokens, more than {states[0]} past it (a state cannot be rewound): decode loaded fewer "
            f"tokens than prefill computes (a prefix hit rounded to a block?), so this request cannot move; it needs "
            f"prefill to stop where decode resumes")


def check_registration(reg: Register, peer: PeerInfo, rank: tuple[int, int], stage: tuple[int, int],
                       block_size: int) -> None:
    """Every check of a registration that needs only the decode rank it came from, run before anything is kept
    (also for one that waits for its request): its rank, layers, token range, block ids (each list no longer than
    the decode cache, every needed block inside its region) and staging slot. Raises RegistrationError /
    DescriptorError naming the problem."""
    tid, key, layer_routes = reg.transfer_id, peer.key, peer.layer_routes
    if (reg.dst_pp, reg.dst_tp) != key[1:]:
        raise RegistrationError(f"registration names decode rank ({reg.dst_pp},{reg.dst_tp}) but arrived on "
                                f"the connection of rank {key[1:]}: a rank registers only its own blocks")
    if reg.num_tokens <= 0:
        raise RegistrationError(f"registration of {tid!r} asks for {reg.num_tokens} tokens")
    views = peer.accepted.views
    unit = views.unit if views is not None else block_size  # (the smaller side's blocks, where sizes differ)
    if not (0 <= reg.first_token <= reg.num_tokens) or reg.first_token % unit:
        raise RegistrationError(f"first_token {reg.first_token} must be a multiple of the block size "
                                f"{unit} within 0..{reg.num_tokens}")
    # Every decode rank registers with every prefill rank, also where the plan routes nothing between them
    # (e.g. replicated MLA pools come from one prefill TP rank): such a rank completes at once, so it never
    # holds its blocks waiting for a registration that would not come.
    foreign = sorted(set(reg.layers) - set(layer_routes))
    if foreign:
        raise RegistrationError(f"registration of {tid!r} asks prefill rank {rank} (layers {stage[0]}-{stage[1] - 1}) "
                                f"for layers {foreign[:20]} it does not send to decode rank {key[1:]}: "
                                f"the two sides disagree on the layer split")
    groups = reg.groups
    # Live ids only: a sliding window's group lists a position for every block of the prompt, most of them vLLM's
    # null block once the window moved on (the wire type bounds the list itself).
    longest = max((int(np.count_nonzero(ids != peer.hello.null_block)) for ids in groups), default=0)
    if longest > peer.max_blocks:
        raise RegistrationError(f"registration of {tid!r} lists {longest} live block ids in one group; decode rank "
                                f"{key[1:]}'s cache has {peer.max_blocks} blocks")
    _check_staging(reg, peer)
    routes = [r for rs in layer_routes.values() for r in rs]
    regions = peer.accepted.regions
    need: dict[int, tuple[int, bool]] = {}
    """Group -> (block ids it needs for the prompt, whether it holds a per-request state)."""
    regions_of_group: dict[int, Region] = {}
    for r in routes:
        region = regions[(r.pool, r.layer)]
        regions_of_group[region.group] = region
        need[region.group] = (1 + region.scratch_blocks, True) if region.per_request else \
            (blocks_for(reg.num_tokens, region.block_size or peer.hello.block_size), False)
    for g, (blocks_needed, per_request) in sorted(need.items()):
        if g >= len(groups):
            raise RegistrationError(f"registration of {tid!r} has {len(groups)} block-id group(s) but "
                                    f"decode regions use group {g}")
        ids = groups[g]
        if len(ids) < blocks_needed:
            raise RegistrationError(f"group {g} has {len(ids)} block ids for {reg.num_tokens} tokens, needs "
                                    f"{blocks_needed}{' (a per-request state)' if per_request else ''}")
        live = ids[group_range(regions_of_group[g], 0, 0, True)] if per_request else ids[:blocks_needed]
        live = live[live != peer.hello.null_block]  # null: outside decode's window
        if np.unique(live).size != live.size:
            raise RegistrationError(f"group {g} block ids repeat: each token block needs its own block")
    for r in routes:  # every destination block inside its region (raises DescriptorError naming them)
        region = regions[(r.pool, r.layer)]
        blocks_needed, per_request = need[region.group]
        ids = groups[region.group]
        check_blocks(region, ids[group_range(region, 0, 0, True)] if per_request else ids[:blocks_needed],
                     f"decode {r.pool} layer {r.layer} ")


def _check_staging(reg: Register, peer: PeerInfo) -> None:
    """The staging slot decode names must lie inside the staging buffer its Auth announced (or be none)."""
    offset, nbytes, size = reg.staging_offset, reg.staging_bytes, peer.hello.staging_bytes
    if nbytes == 0 and offset == 0:
        return
    if nbytes <= 0 or offset < 0 or not peer.hello.staging_addr or offset + nbytes > size:
        raise RegistrationError(f"registration of {reg.transfer_id!r} names staging slot {offset}+{nbytes} B but "
                                f"decode rank {peer.key[1:]} announced a staging buffer of {size} B: the slot must "
                                f"lie inside it (or be 0+0 for direct WRITEs)")


def parked_cost(reg: Register) -> int:
    """Bytes a registration would hold as a Parked one: its packed block ids (4 per id), 4 per layer (8 beyond
    2**31), plus its objects."""
    return sum(len(g) for g in reg.block_ids) + 4 * len(reg.layers) + 112 * len(reg.block_ids) + 400 + \
        len(reg.transfer_id)


def given_up_note(req: SendRequest, given_up_keep_s: float) -> tuple[int, str]:
    """(level, message) prefill logs when it frees the KV of a request a decode engine gave up: named by the refusal
    that gave it up (a warning: a deployment problem), or an early abort nobody else followed (routine)."""
    if req.given_up_why:
        return logging.WARNING, f"transfer {req.transfer_id}: freeing its KV unread: {req.given_up_why}"
    return logging.INFO, (f"transfer {req.transfer_id}: decode engine {req.given_up_by!r} gave it up before "
                          f"registering and no other engine registered it within {given_up_keep_s:g} s; freeing "
                          f"its KV")


def lease_expiry_note(req: SendRequest, lease_s: float, last_refusal: str = "") -> str:
    """What prefill logs when a request's lease runs out: its KV is freed, read by nobody or only by some.
    `last_refusal`: the last decode rank refused at this side channel's handshake, and why."""
    if req.expected is None:
        seen = f"; the last decode refused here was {last_refusal}" if last_refusal else ""
        return (f"transfer {req.transfer_id}: lease of {lease_s:.0f} s expired and no decode ever registered for it; "
                f"its KV is freed unread. Either no decode engine got the request (did the router send the decode "
                f"leg with prefill's kv_transfer_params?) or decode could not reach this side channel (its log says "
                f"why){seen}")
    return (f"transfer {req.transfer_id}: lease of {lease_s:.0f} s expired; decode ranks {sorted(req.expected)} "
            f"never completed; freeing its blocks")


class RecentIds:
    """Transfer ids remembered for `keep_s` seconds (so a late message about one is answered clearly), then
    forgotten: a bounded memory of what happened, not a growing one. At most `max_ids` (the oldest go first), each
    with an optional value (e.g. which decode engine it concerns)."""

    def __init__(self, keep_s: float, max_ids: int = 1 << 16) -> None:
        self.keep_s, self.max_ids = keep_s, max_ids
        self._at: dict[str, tuple[float, Any]] = {}

    def add(self, transfer_id: str, now: float, value: Any = None) -> None:
        """Remember `transfer_id` (with `value`) from `now` (time.monotonic())."""
        self._at.pop(transfer_id, None)  # (re)inserted last: the dict stays oldest-first
        self._at[transfer_id] = (now, value)
        while len(self._at) > self.max_ids:
            del self._at[next(iter(self._at))]

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._at

    def __len__(self) -> int:
        return len(self._at)

    def get(self, transfer_id: str) -> Any:
        entry = self._at.get(transfer_id)
        return entry[1] if entry is not None else None

    def discard(self, transfer_id: str) -> bool:
        """Forget it now; True if it was there."""
        return self._at.pop(transfer_id, None) is not None

    def expire(self, now: float) -> list[str]:
        """Forget (and return) the ids older than `keep_s`."""
        old = []
        for tid, (at, _value) in self._at.items():
            if now - at <= self.keep_s:
                break  # oldest first: the rest are younger
            old.append(tid)
        for tid in old:
            del self._at[tid]
        return old
