"""The prefill rank's rules about who owns which transfer (connector.engine.ownership) and the registration check
(connector.engine.sender_state.check_registration), as tables of cases against pure objects: no NIXL, no sockets,
no processes. tests/test_stream_faults.py and tests/test_security*.py run the same rules over real connections."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest

from connector.core.errors import DescriptorError, RegistrationError
from connector.core.layout import ParallelLayout
from connector.engine.config import SenderConfig
from connector.engine.ownership import Ownership
from connector.engine.sender_state import RecentIds, SendRequest, check_registration, parked_cost
from connector.protocol.messages import Register
from tests.helpers import accepted_decode_peer, make_model, rank_hello

MODEL = make_model("ddkkvk")
"""Six layers: 0-1 dense, 2, 3 and 5 sparse K-only, 4 sparse with an index value."""
BLOCK, NUM_BLOCKS, TOKENS = 16, 64, 64
ONE = ParallelLayout.build(MODEL.num_layers, 1, 1)
OWN = rank_hello(MODEL, "prefill", ONE, block_size=BLOCK)
CONFIG = SenderConfig(lease_s=100.0, given_up_keep_s=2.0, max_parked_per_connection=3)
NOW = 1000.0


@dataclass(eq=False)
class Conn:
    """A connection as the rules see one: an identity that may be closed."""

    is_closed: bool = False


def peer(engine: str = "decode-a", rank: tuple[int, int] = (0, 0), decode: ParallelLayout = ONE, *,
         num_blocks: int = NUM_BLOCKS, **kw):
    return accepted_decode_peer(OWN, MODEL, rank_hello(MODEL, "decode", decode, rank, engine=engine,
                                                       block_size=BLOCK, num_blocks=num_blocks, **kw))


def register(tid: str = "t1", rank: tuple[int, int] = (0, 0), **kw) -> Register:
    fields = dict(block_ids=[list(range(4)), list(range(10, 14))], first_token=0, num_tokens=TOKENS,
                  layers=list(range(MODEL.num_layers)))
    fields.update(kw)
    return Register(tid, *rank, **fields)


def ownership(config: SenderConfig = CONFIG) -> Ownership:
    return Ownership(config, (0, 0), (0, MODEL.num_layers), BLOCK)


def started(own: Ownership, tid: str = "t1", computed: bool = False) -> SendRequest:
    req = SendRequest(tid, TOKENS, [])
    own.start(req, NOW)
    if computed:
        own.all_computed(req, NOW)
    return req


# ---- check_registration: one rule per row ---------------------------------------------------------------------
@pytest.mark.parametrize("change, error, match", [
    (dict(), None, ""),
    (dict(rank=(0, 1)), RegistrationError, r"names decode rank \(0,1\) but arrived on the connection of rank \(0, 0\)"),
    (dict(num_tokens=0), RegistrationError, "asks for 0 tokens"),
    (dict(first_token=5), RegistrationError, "multiple of the block size 16"),
    (dict(first_token=TOKENS + BLOCK), RegistrationError, "within 0..64"),
    (dict(layers=[0, 6, 9]), RegistrationError, r"for layers \[6, 9\] it does not send"),
    (dict(block_ids=[list(range(NUM_BLOCKS + 1)), list(range(4))]), RegistrationError, "lists 65 live block ids"),
    (dict(block_ids=[list(range(4))]), RegistrationError, "has 1 block-id group"),
    (dict(block_ids=[list(range(3)), list(range(4))]), RegistrationError, "group 0 has 3 block ids for 64 tokens"),
    (dict(block_ids=[[1, 2, 2, 3], list(range(4))]), RegistrationError, "group 0 block ids repeat"),
    (dict(block_ids=[[1, 2, 3, NUM_BLOCKS], list(range(4))]), DescriptorError, r"block ids \[64\] are outside kv"),
    (dict(block_ids=[list(range(4)), [0, 1, 2, -1]]), DescriptorError, r"block ids \[-1\] are outside index_k"),
    (dict(block_ids=[list(range(4)) + [NUM_BLOCKS + 9], list(range(4))]), None, ""),  # past num_tokens: unused
    (dict(staging_offset=0, staging_bytes=4096), RegistrationError, "announced a staging buffer of 0 B"),
])
def test_check_registration(change, error, match):
    rank = change.pop("rank", (0, 0))
    reg = register(rank=rank, **change)
    if error is None:
        check_registration(reg, peer(), (0, 0), (0, MODEL.num_layers), BLOCK)
    else:
        with pytest.raises(error, match=match):
            check_registration(reg, peer(), (0, 0), (0, MODEL.num_layers), BLOCK)


@pytest.mark.parametrize("offset, nbytes, ok", [(0, 0, True), (0, 4096, True), (4096, 4096, True),
                                                (4097, 4096, False), (-1, 10, False), (0, -4, False)])
def test_check_registration_staging_slot_inside_the_announced_buffer(offset, nbytes, ok):
    decode = peer(staging_bytes=8192)
    reg = register(staging_offset=offset, staging_bytes=nbytes)
    if ok:
        check_registration(reg, decode, (0, 0), (0, MODEL.num_layers), BLOCK)
    else:
        with pytest.raises(RegistrationError, match="must lie inside it"):
            check_registration(reg, decode, (0, 0), (0, MODEL.num_layers), BLOCK)


def test_check_registration_knows_what_this_rank_sends_under_a_pp_split():
    """Prefill PP=2 (layers 0-2, 3-5) into decode PP=1: stage 1 sends layers 3-5 only, and says which it lacks."""
    two = ParallelLayout.build(MODEL.num_layers, 1, 2, [3, 3])
    own = rank_hello(MODEL, "prefill", two, (1, 0), block_size=BLOCK)
    decode = accepted_decode_peer(own, MODEL, rank_hello(MODEL, "decode", ONE, block_size=BLOCK))
    assert sorted(decode.layer_routes) == [3, 4, 5]
    check_registration(register(layers=[3, 4, 5]), decode, (1, 0), (3, 6), BLOCK)
    with pytest.raises(RegistrationError, match=r"\(layers 3-5\) for layers \[2\]"):
        check_registration(register(layers=[2, 3]), decode, (1, 0), (3, 6), BLOCK)


# ---- first registration pins the transfer to a decode engine -------------------------------------------------------
@pytest.mark.parametrize("steps, refused_by", [
    (["park a0", "park a1"], None),            # the same engine's other rank: welcome
    (["park a0", "start", "serve a1"], None),
    (["start", "serve a0", "serve a1"], None),
    (["park a0", "park b"], "decode-a"),
    (["park a0", "start", "serve b"], "decode-a"),  # served at start: nobody comes between
    (["start", "serve a0", "serve b"], "decode-a"),
    (["start", "serve b", "serve a0"], "decode-b"),  # whoever comes first
])
def test_the_first_registration_pins_the_transfer_to_its_engine(steps, refused_by):
    own, two = ownership(), ParallelLayout.build(6, 2, 1)
    peers = {"a0": peer("decode-a", (0, 0), two), "a1": peer("decode-a", (0, 1), two), "b": peer("decode-b")}
    for i, step in enumerate(steps):
        what, _, who = step.partition(" ")
        if what == "start":
            assert all(refusal is None for _, refusal in own.start(SendRequest("t1", TOKENS, []), NOW))
            continue
        decode = peers[who]
        act = own.park if what == "park" else own.serve
        if i == len(steps) - 1 and refused_by is not None:
            with pytest.raises(RegistrationError, match=rf"belongs to decode engine {refused_by!r} \(the first"):
                act(Conn(), decode, register(rank=decode.key[1:]), NOW)
        else:
            act(Conn(), decode, register(rank=decode.key[1:]), NOW)
    assert own.owner_of("t1") == (refused_by or "decode-a")


def test_registrations_wait_for_their_request_and_are_served_by_start():
    own, conn, decode = ownership(), Conn(), peer()
    own.park(conn, decode, register(), NOW)
    assert (own.parked_count, decode.parked) == (1, 1) and decode.parked_bytes == parked_cost(register())
    req = SendRequest("t1", TOKENS, [])
    [(waited, refusal)] = own.start(req, NOW)
    assert waited.conn is conn and waited.register == register() and refusal is None
    assert (own.parked_count, decode.parked, decode.parked_bytes) == (0, 0, 0)
    assert req.owner == "decode-a" and list(req.dests) == [decode.key] and req.dests[decode.key].conn is conn
    assert req.expected == {("decode-a", 0, 0)}


def test_a_waiting_registration_refused_at_start_gets_its_refusal():
    own, decode = ownership(), peer()
    own.park(Conn(), decode, register(num_tokens=TOKENS + BLOCK, block_ids=[[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]), NOW)
    [(_, refusal)] = own.start(SendRequest("t1", TOKENS, []), NOW)
    assert isinstance(refusal, RegistrationError) and "decode asks for 80" in str(refusal)
    assert not own.requests["t1"].dests and own.owner_of("t1") is None


@pytest.mark.parametrize("case, match", [
    ("after_prefill", "restarted since"),
    ("released", "already finished, expired or was aborted"),
    ("twice", "registered 't1' twice"),
    ("more_tokens", "has 64 prompt tokens on prefill but decode asks for 80"),
    ("closed", "closed its connection"),
])
def test_registrations_refused(case, match):
    own, decode = ownership(), peer()
    reg = register(after_prefill=case == "after_prefill")
    if case == "more_tokens":
        reg = register(num_tokens=TOKENS + BLOCK, block_ids=[[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
    if case == "released":
        own.release(started(own), NOW)
    elif case != "after_prefill":
        started(own)
    if case == "twice":
        own.serve(Conn(), decode, reg, NOW)
    act = own.park if case == "after_prefill" else own.serve
    with pytest.raises(RegistrationError, match=match):
        act(Conn(is_closed=case == "closed"), decode, reg, NOW)
    nothing_started = case in ("released", "after_prefill")
    assert not own.parked and [len(r.dests) for r in own.requests.values()] == \
        ([] if nothing_started else [1] if case == "twice" else [0])


def test_waiting_registrations_are_bounded_in_all_connections_together():
    """Each connection within its own allowance, the registrations of all of them are bounded too (max_parked,
    max_parked_bytes); what a connection's close drops frees the room again, and a parked one is kept compact."""
    config = replace(CONFIG, max_parked_per_connection=100, max_parked=5, max_parked_bytes=1 << 20)
    own = ownership(config)
    conns = [(Conn(), peer(f"decode-{i}")) for i in range(3)]
    for i in range(5):
        conn, decode = conns[i % 3]
        own.park(conn, decode, register(f"t{i}"), NOW)
    with pytest.raises(RegistrationError, match="limits.max_parked=5, limits.max_parked_bytes=1048576"):
        own.park(*conns[2], register("t-more"), NOW)
    conn, decode = conns[0]
    own.connection_closed(conn, decode.key)
    assert own.parked_count == 3 and own.parked_bytes == 3 * parked_cost(register("t1"))
    own.park(*conns[2], register("t-more"), NOW)
    kept = own.parked["t-more"][0]
    assert kept.stripped.groups[0].dtype.itemsize == 4 and kept.register == register("t-more")
    big = replace(CONFIG, max_parked_bytes=4096)
    own, decode = ownership(big), peer(num_blocks=2000)
    with pytest.raises(RegistrationError, match="max_parked_bytes=4096"):
        own.park(Conn(), decode, register("t-big", block_ids=[list(range(4)) + [0] * 996] * 2), NOW)
    assert own.parked_bytes == own.parked_count == 0


@pytest.mark.parametrize("count, ids_each, refused", [
    (3, 4, False),       # max_parked_per_connection=3
    (4, 4, True),
    (1, 40_000, False),     # 2 x 40,000 ids x 4 B (kept as int32 arrays) = 320 kB < 16 MiB
    (1, 2_100_000, True),   # 16.8 MB > 16 MiB
])
def test_waiting_registrations_are_bounded_per_connection(count, ids_each, refused):
    config = replace(CONFIG, max_parked_bytes_per_connection=16 << 20)
    own, decode, conn = ownership(config), peer(num_blocks=ids_each), Conn()
    ids = list(range(4)) + [0] * (ids_each - 4)  # (only the first 4 blocks are read for 64 tokens)
    regs = [register(f"t{i}", block_ids=[ids, ids]) for i in range(count)]
    for reg in regs[:-1]:
        own.park(conn, decode, reg, NOW)
    if refused:
        with pytest.raises(RegistrationError, match="limits.max_parked_per_connection=3, limits.max_parked_bytes_per_conn"):
            own.park(conn, decode, regs[-1], NOW)
    else:
        own.park(conn, decode, regs[-1], NOW)
    assert decode.parked == own.parked_count == count - refused
    # another connection has its own allowance
    own.park(Conn(), peer("decode-b"), register("t-other"), NOW)


def test_waiting_registrations_expire_after_the_lease_and_give_their_allowance_back():
    own, decode = ownership(), peer()
    own.park(Conn(), decode, register("old"), NOW)
    own.park(Conn(), decode, register("new"), NOW + 60)
    assert own.expired_waits(NOW + 100) == []
    [(tid, [entry])] = own.expired_waits(NOW + 100.5)
    assert tid == "old" and entry.register.transfer_id == "old"
    assert list(own.parked) == ["new"] and decode.parked == 1 and decode.parked_bytes == parked_cost(register("new"))


# ---- heartbeats ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sender, computed, extended", [
    ("same connection", True, True),
    ("same connection", False, False),   # still computing: its lease has not started
    ("other connection", True, False),   # the same identity on another connection owns nothing here
    ("other engine", True, False),
])
def test_heartbeats_extend_only_leases_of_the_connections_own_transfers(sender, computed, extended):
    own, conn, decode = ownership(), Conn(), peer()
    req = started(own, computed=computed)
    own.serve(conn, decode, register(), NOW)
    before = req.lease_deadline
    key = peer("decode-b").key if sender == "other engine" else decode.key
    own.heartbeat(conn if sender != "other connection" else Conn(), key, ["t1", "unknown"], NOW + 50)
    assert req.lease_deadline == (NOW + 150 if extended else before)
    assert (before == NOW + 100) == computed and (before == math.inf) != computed


# ---- aborts ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("state, asker, foreign, destination, fails, gives_up", [
    ("unknown", "a", None, False, False, True),      # decode gave up before prefill started it: pinned to a
    ("released", "a", None, False, False, False),    # too late to matter
    ("parked by a", "a", None, False, False, True),  # its own waiting registration goes, and it is pinned
    ("parked by a", "b", "decode-a", False, False, False),
    ("started", "a", None, False, False, True),      # started, nobody registered: pinned to a
    ("served to a", "a", None, True, True, False),
    ("served to a", "a rank 1", None, False, True, False),  # another rank of the owner: nothing written there
    ("served to a", "b", "decode-a", False, False, False),
])
def test_abort_verdicts(state, asker, foreign, destination, fails, gives_up):
    own, conn = ownership(), Conn()
    two = ParallelLayout.build(6, 2, 1)
    a, a1, b = peer("decode-a", (0, 0), two), peer("decode-a", (0, 1), two), peer("decode-b")
    if state == "released":
        own.release(started(own), NOW)
    elif state == "parked by a":
        own.park(conn, a, register(), NOW)
    elif state in ("started", "served to a"):
        started(own)
    if state == "served to a":
        own.serve(conn, a, register(), NOW)
    who = {"a": a, "a rank 1": a1, "b": b}[asker]
    again = Conn()  # decode asks over a new connection (e.g. after a cut link)
    verdict = own.abort(conn if (state, asker) == ("parked by a", "a") else again if asker == "a" else Conn(),
                        who.key, "t1")
    assert verdict.foreign_owner == foreign
    assert (verdict.destination is not None) == destination and verdict.fails_request == fails
    assert verdict.gives_up == gives_up
    if destination:
        assert verdict.destination.conn is again  # Stopped is answered where it was asked
        assert who.key not in verdict.request.expected
    if state == "parked by a":
        assert bool(own.parked) == (asker == "b")


def test_an_early_give_up_is_pinned_to_its_engine_and_undone_by_any_registration():
    own = ownership()
    own.give_up("t1", "decode-a", NOW)
    req = started(own, computed=True)
    assert req.given_up_by == "decode-a" and "t1" not in own.given_up
    assert req.lease_deadline == NOW + CONFIG.given_up_keep_s  # not the 100 s lease
    own.serve(Conn(), peer("decode-b"), register(), NOW + 1)  # an unrelated engine's abort denies nothing
    assert req.given_up_by is None and req.lease_deadline == NOW + 1 + CONFIG.lease_s


def test_a_give_up_of_a_started_request_shortens_its_lease_and_a_waiting_registration_clears_it():
    own = ownership()
    req = started(own, computed=True)
    own.give_up("t1", "decode-a", NOW + 10)
    assert req.given_up_by == "decode-a" and req.lease_deadline == NOW + 12
    own.give_up("t2", "decode-a", NOW)
    own.park(Conn(), peer("decode-b"), register("t2"), NOW)
    assert "t2" not in own.given_up


# ---- connections ----------------------------------------------------------------------------------------------------
def test_a_closed_connection_ends_what_it_held_and_nothing_else():
    own, conn, other = ownership(), Conn(), Conn()
    two = ParallelLayout.build(6, 2, 1)
    a0, a1 = peer("decode-a", (0, 0), two), peer("decode-a", (0, 1), two)
    r1, r2 = started(own, "t1"), started(own, "t2")
    _, d1 = own.serve(conn, a0, register("t1"), NOW)
    own.serve(other, a1, register("t1", rank=(0, 1)), NOW)
    _, d2 = own.serve(conn, a0, register("t2"), NOW)
    d2.done = True  # completed already: nothing to drop
    own.park(conn, a0, register("t3"), NOW)
    own.park(other, a1, register("t3", rank=(0, 1)), NOW)
    assert own.connection_closed(conn, a0.key) == [(r1, d1)]
    assert d1.done and r1.expected == {a1.key} and r2.expected == {a0.key, a1.key}
    assert [p.conn for p in own.parked["t3"]] == [other] and a0.parked == 0 and a1.parked == 1
    assert own.connection_closed(conn, a0.key) == []  # once


def test_nothing_outlives_a_released_request():
    own, conn, decode = ownership(), Conn(), peer()
    for i in range(40):
        req = started(own, f"t{i}")
        own.serve(conn, decode, register(f"t{i}"), NOW)
        assert own.release(req, NOW) and not own.release(req, NOW)
    assert not own.requests and not own.parked and len(own.released) == 40
    assert own.forget_old(NOW + CONFIG.released_memory_s + 1) == [f"t{i}" for i in range(40)]
    assert not own.released


# ---- RecentIds: a bounded memory of what happened ------------------------------------------------------------------
def test_recent_ids_remember_for_keep_s_oldest_first():
    ids = RecentIds(keep_s=10.0)
    ids.add("a", NOW, "engine-1")
    ids.add("b", NOW + 5)
    assert "a" in ids and ids.get("a") == "engine-1" and ids.get("b") is None and ids.get("zzz") is None
    assert ids.expire(NOW + 10) == [] and len(ids) == 2  # exactly keep_s old: still kept
    assert ids.expire(NOW + 10.5) == ["a"] and "a" not in ids
    ids.add("b", NOW + 20)  # added again: younger now
    assert ids.expire(NOW + 16) == [] and ids.expire(NOW + 31) == ["b"] and not ids


def test_recent_ids_keep_at_most_max_ids_dropping_the_oldest():
    ids = RecentIds(keep_s=1e9, max_ids=3)
    for i, tid in enumerate("abcd"):
        ids.add(tid, NOW + i)
    assert [t for t in "abcd" if t in ids] == ["b", "c", "d"]
    ids.add("b", NOW + 9)  # re-added: now the youngest, so "c" goes next
    ids.add("e", NOW + 10)
    assert [t for t in "bcde" if t in ids] == ["b", "d", "e"]
    assert ids.discard("d") and not ids.discard("d") and len(ids) == 2


# ---- the transfer's capability (transfer_secret) ------------------------------------------------------------------
SECRET = "s3cret-of-t1"


@dataclass(eq=False)
class NoncedConn(Conn):
    """A connection with its handshake nonces (what a transfer proof is bound to)."""

    nonces: bytes = b"n" * 64


def proof(conn: NoncedConn, secret: str = SECRET, tid: str = "t1") -> bytes:
    from connector.protocol.auth import transfer_proof

    return transfer_proof(secret, conn.nonces, tid)


@pytest.mark.parametrize("how, refused", [
    ("valid", ""), ("none", "proves none"), ("wrong secret", "is wrong"), ("other connection", "is wrong"),
    ("other transfer", "is wrong"),
])
def test_a_transfer_with_a_secret_is_served_only_to_its_proof(how, refused):
    from connector.core.errors import CapabilityError

    own, conn = ownership(), NoncedConn()
    req = started(own)
    req.secret = SECRET
    p = {"valid": proof(conn), "none": b"", "wrong secret": proof(conn, "guess"),
         "other connection": proof(NoncedConn(nonces=b"m" * 64)), "other transfer": proof(conn, tid="t2")}[how]
    if not refused:
        own.serve(conn, peer(), register(proof=p), NOW)
        assert req.owner == "decode-a"
        return
    with pytest.raises(CapabilityError, match=refused):
        own.serve(conn, peer(), register(proof=p), NOW)
    assert req.owner is None and not req.dests


def test_a_registration_with_a_proof_waits_whoever_came_first_and_the_proof_decides_at_start():
    """A token holder parks an open registration for the id first: a proving one still waits, and is the one
    served when the request starts with its secret; the first is refused then."""
    own, first, second = ownership(), NoncedConn(), NoncedConn(nonces=b"v" * 64)
    own.park(first, peer("decode-mallory"), register(), NOW)
    own.park(second, peer("decode-victim"), register(proof=proof(second)), NOW)
    req = SendRequest("t1", TOKENS, [], secret=SECRET)
    answers = own.start(req, NOW)
    assert [(p.peer.key[0], type(err).__name__ if err else None) for p, err in answers] == \
        [("decode-mallory", "CapabilityError"), ("decode-victim", None)]
    assert req.owner == "decode-victim"


def test_an_abort_without_a_destination_needs_the_proof():
    own, victim, other = ownership(), NoncedConn(), NoncedConn(nonces=b"x" * 64)
    req = started(own)
    req.secret = SECRET
    own.serve(victim, peer("decode-v"), register(proof=proof(victim)), NOW)
    impostor = peer("decode-v", (0, 1), ParallelLayout.build(MODEL.num_layers, 2, 1)).key
    verdict = own.abort(other, impostor, "t1")
    assert "abort proves none" in verdict.unproven and not verdict.fails_request
    assert own.abort(other, impostor, "t1", proof(other)).fails_request  # the decode's own rank: it has the secret


@pytest.mark.parametrize("who", ["unrelated engine", "refused handshake", "its decode, with the proof"])
def test_an_early_give_up_of_a_transfer_with_a_secret_counts_only_with_the_proof(who):
    """A give-up before the request starts is weighed when it starts with its secret: a token holder's abort (or
    an unauthenticated handshake refusal naming the transfer) leaves the full lease for the real decode, which
    may register long after `given_up_keep_s`; the decode's own proven give-up still frees the KV early."""
    own, conn = ownership(), NoncedConn()
    if who == "unrelated engine":
        own.give_up("t1", "decode-mallory", NOW, nonces=conn.nonces, proof=proof(conn, "guess"))
    elif who == "refused handshake":
        assert own.refused("t1", "decode-v", "another token", NOW)
    else:
        own.give_up("t1", "decode-mallory", NOW, nonces=conn.nonces)  # pushed out of nothing: the proven one counts
        own.give_up("t1", "decode-v", NOW, nonces=conn.nonces, proof=proof(conn))
    req = SendRequest("t1", TOKENS, [], secret=SECRET)
    own.start(req, NOW)
    own.all_computed(req, NOW)
    if who == "its decode, with the proof":
        assert req.given_up_by == "decode-v" and req.lease_deadline == NOW + CONFIG.given_up_keep_s
    else:
        assert req.given_up_by is None and req.lease_deadline == NOW + CONFIG.lease_s
    assert "t1" not in own.given_up


def test_a_handshake_refusal_does_not_shorten_a_started_transfer_with_a_secret():
    own = ownership()
    req = SendRequest("t1", TOKENS, [], secret=SECRET)
    own.start(req, NOW)
    own.all_computed(req, NOW)
    assert not own.refused("t1", "decode-v", "another token", NOW + 1)
    assert req.given_up_by is None and req.lease_deadline == NOW + CONFIG.lease_s


@pytest.mark.parametrize("proven", [False, True])
def test_a_give_up_weighed_before_its_request_started_still_needs_the_proof_after(proven):
    """The race CI found: the abort's verdict is weighed while the request is unknown, then the framework thread's
    queued start runs (the sender drains its inbox) before the give-up is recorded. A token holder's abort must not
    shorten the started request's lease then either; its decode's proven one does."""
    own, conn = ownership(), NoncedConn()
    verdict = own.abort(conn, peer("decode-mallory").key, "t1", proof(conn, SECRET if proven else "guess"))
    assert verdict.gives_up and verdict.request is None
    req = SendRequest("t1", TOKENS, [], secret=SECRET)
    own.start(req, NOW)
    own.all_computed(req, NOW)
    own.give_up("t1", "decode-mallory", NOW, nonces=conn.nonces,
                proof=proof(conn, SECRET if proven else "guess"))
    if proven:
        assert req.given_up_by == "decode-mallory" and req.lease_deadline == NOW + CONFIG.given_up_keep_s
    else:
        assert req.given_up_by is None and req.lease_deadline == NOW + CONFIG.lease_s
