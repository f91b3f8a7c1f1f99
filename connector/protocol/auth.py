"""Mutual challenge-response authentication of the side-channel handshake. Pure: no sockets, no clocks.

Both sides hold the same `auth_token`; it never crosses the wire. Each side sends a fresh random nonce in its Hello.
Prefill proves it knows the token with an HMAC-SHA256 over the transcript (both Hellos, nonces included, with its own
proof left empty); decode checks that proof before it sends anything about its memory, then proves the token with an
HMAC over the transcript and its Auth message. Because the transcript holds both nonces, a captured proof is useless
on any other connection (the other side's nonce differs), and because it holds both identities (roles, engine ids,
ranks, agent names, fingerprints) and decode's memory, a proof cannot be moved to another claim.

What this does not do: hide or protect what follows the handshake. Without TLS an eavesdropper reads the messages
and a man in the middle can rewrite them; `tls_cert_file` (connector.transport.tls) closes that gap.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from connector.core.errors import ControlError
from connector.protocol.messages import NONCE_BYTES, PROTOCOL_VERSION, Auth, Hello, encode_body

DOMAIN = b"sparse-kv-connector side channel v%d\x00" % PROTOCOL_VERSION
"""Prefix of every transcript: a proof made for another protocol or version never verifies here."""
TOKEN_DIFFERS = "auth_token differs between prefill and decode"
"""How every failed proof starts, on both sides (decode tells prefill when it refuses prefill's proof)."""
MEMORY_FIELDS = ("agent_metadata", "regions", "staging_addr", "staging_device", "staging_bytes")
"""The Hello fields that describe a rank's memory: sent only in Auth, and only by decode."""


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def identity(hello: Hello) -> Hello:
    """`hello` as it goes on the wire, and as the transcript holds it: no memory, no proof and no signature."""
    return msgspec.structs.replace(hello, agent_metadata=b"", regions=[], staging_addr=0, staging_device=0,
                                   staging_bytes=0, proof=b"", signature=b"")


def memory_of(hello: Hello, proof: bytes = b"", claim: Hello | None = None) -> Auth:
    """The Auth that carries `hello`'s memory and `claim`, who the sender is (its identity as on the wire)."""
    return Auth(proof=proof, hello=claim, **{name: getattr(hello, name) for name in MEMORY_FIELDS})


def opening(claim: Hello) -> Hello:
    """What decode says first (protocol 8): `claim` (its identity, as on the wire) with everything that tells which
    decode it is left out (engine id, ranks, agent name, engine key, the transfer it came for), so a listener that
    a request named as prefill_addr learns only that a decode of this model called. The model's fields stay:
    prefill explains a model mismatch from them. Who it is goes in Auth.hello, once prefill proved itself."""
    return msgspec.structs.replace(claim, engine_id="", agent_name="", engine_key=b"", for_transfer="", pp_rank=0,
                                   tp_rank=0, pp_size=0, tp_size=0, stages=[], null_block=-1)


LANE_BYTES = 16


def lane_tag(token: str, hello: Hello) -> bytes:
    """Decode's pseudonym for prefill's admission lanes (Hello.lane): HMAC(token, engine id and ranks), the same on
    every connection of the rank, so a prefill that saw it authenticate recognises its opening; without the token,
    no name can be read from it."""
    return _mac(token, b"lane\x00", f"{hello.engine_id}\x00{hello.pp_rank}\x00{hello.tp_rank}".encode())[:LANE_BYTES]


def check_lane(token: str, claim: Hello) -> None:
    """Raises ControlError unless the lane of decode's opening is the one its identity gives (else a peer could
    take a lane that is not its own in prefill's admission table)."""
    if not hmac.compare_digest(claim.lane, lane_tag(token, claim)):
        raise ControlError(f"decode engine {claim.engine_id!r} rank ({claim.pp_rank},{claim.tp_rank}) opened with a "
                           f"lane tag that is not its own: a relay or a broken peer")


def check_claim(first: Hello, claim: Hello | None, who: str) -> Hello:
    """The identity decode's Auth claims, checked against its opening `first`: the same connection (nonce) and the
    same model. Raises ControlError naming what differs."""
    if claim is None:
        raise ControlError(f"{who} sent an Auth without its Hello: it runs an older side-channel protocol")
    if opening(claim) != first:
        raise ControlError(f"{who}'s Hello in its Auth does not match its opening Hello (another nonce, role or "
                           f"model): a relay or a broken peer")
    return claim


def with_memory(hello: Hello, auth: Auth) -> Hello:
    """A peer's Hello completed with the memory its Auth carried (what the server keeps as `conn.peer`)."""
    return msgspec.structs.replace(hello, proof=b"", signature=b"",
                                   **{name: getattr(auth, name) for name in MEMORY_FIELDS})


def transcript(client: Hello, server: Hello) -> bytes:
    """What both proofs cover: the two Hellos as sent (nonces included), proofs left out."""
    return DOMAIN + encode_body(identity(client)) + b"\x00" + encode_body(identity(server))


def _mac(token: str, label: bytes, data: bytes) -> bytes:
    return hmac.new(token.encode(), label + data, hashlib.sha256).digest()


def server_proof(token: str, client: Hello, server: Hello) -> bytes:
    """Prefill's proof: HMAC(token, "prefill" + transcript)."""
    return _mac(token, b"prefill\x00", transcript(client, server))


def client_proof(token: str, client: Hello, server: Hello, auth: Auth) -> bytes:
    """Decode's proof: HMAC(token, "decode" + transcript + SHA-256 of its Auth without the proof), so the memory
    that comes with it cannot be swapped."""
    memory = hashlib.sha256(encode_body(msgspec.structs.replace(auth, proof=b""))).digest()
    return _mac(token, b"decode\x00", transcript(client, server) + memory)


def check_nonce(hello: Hello, who: str) -> None:
    if len(hello.nonce) != NONCE_BYTES:
        raise ControlError(f"{who} sent a {len(hello.nonce)}-byte nonce, expected {NONCE_BYTES}: it runs an older or "
                           f"foreign side-channel protocol")


def check_server_proof(token: str, client: Hello, server: Hello) -> None:
    """Decode's check of prefill. Raises ControlError unless `server.proof` is right; without a token, nothing to
    check."""
    if not token:
        return
    if not server.proof:
        raise ControlError(f"{TOKEN_DIFFERS}: decode has one, and prefill did not prove it knows the auth_token (it "
                           f"runs without one): set the same auth_token on prefill, or none on decode")
    if not hmac.compare_digest(server.proof, server_proof(token, client, server)):
        raise ControlError(f"{TOKEN_DIFFERS}: prefill's proof of the auth_token is wrong (the two sides have "
                           f"different tokens, or this is not the prefill you meant to reach); nothing about "
                           f"decode's memory was sent")


def check_client_proof(token: str, client: Hello, server: Hello, auth: Auth) -> None:
    """Prefill's check of decode. Raises ControlError("bad auth token ...") unless `auth.proof` is right."""
    if not token:
        return
    if not auth.proof:
        raise ControlError(f"{TOKEN_DIFFERS} (bad auth token: this prefill requires auth_token and the peer sent no "
                           f"proof): set the same auth_token on decode")
    if not hmac.compare_digest(auth.proof, client_proof(token, client, server, auth)):
        raise ControlError(f"{TOKEN_DIFFERS} (bad auth token: the peer's proof does not match): set the same "
                           f"auth_token on both sides")


# ---- per-transfer capability ---------------------------------------------------------------------------------------
# The side-channel token only says "a member of this cluster". A transfer id is vLLM's request id (the router and
# both engines see it), so it cannot say whose transfer it is. The capability can: an unguessable secret minted per
# transfer that travels only in kv_transfer_params (prefill's response in the sequential flow; the proxy's two legs
# in the concurrent one), never over the side channel. Decode proves it with an HMAC bound to this connection's two
# nonces and the transfer id rather than sending the secret: without TLS an eavesdropper on the side channel (or a
# relay in the middle) would otherwise read it from one Register and claim the transfer at another prefill rank, and
# a recorded proof is useless on any other connection (other nonces) or for any other transfer.

TRANSFER_SECRET_BYTES = 16
"""128 random bits per transfer (`new_transfer_secret`)."""
MAX_TRANSFER_SECRET = 256
"""Longest `transfer_secret` accepted from kv_transfer_params (characters)."""


def new_transfer_secret() -> str:
    """A fresh capability for one transfer: 128 random bits, URL-safe text (22 characters)."""
    return secrets.token_urlsafe(TRANSFER_SECRET_BYTES)


def session_of(client: Hello, server: Hello) -> bytes:
    """What binds a proof to one connection: the client's nonce, then the server's (fresh per connection)."""
    return client.nonce + server.nonce


def transfer_proof(secret: str, session: bytes, transfer_id: str) -> bytes:
    """HMAC-SHA256(secret, "transfer" + connection nonces + transfer id): what a Register (or Abort) carries to
    show that the decode holds `transfer_id`'s secret, on this connection only."""
    return _mac(secret, b"transfer\x00", session + transfer_id.encode())


def transfer_hint(session: bytes, transfer_id: str) -> bytes:
    """How a decode that refuses prefill's Hello names the transfer it came for (Reject.transfer_hint): a digest
    of the transfer id bound to the connection's nonces. The prefill that holds the transfer recognises it
    (`hint_matches`) and frees its KV; a listener learns nothing it could not check against an id it already
    knows."""
    return hashlib.sha256(b"transfer-hint\x00" + session + transfer_id.encode()).digest()


def hint_matches(hint: bytes, session: bytes, transfer_id: str) -> bool:
    return bool(hint) and hmac.compare_digest(hint, transfer_hint(session, transfer_id))


def check_transfer_proof(secret: str, session: bytes, transfer_id: str, proof: bytes) -> str:
    """'' if `proof` proves `secret` for `transfer_id` on the connection `session`; else why not, in words."""
    if not proof:
        return (f"transfer {transfer_id!r} was started with a transfer_secret and this registration proves none: the "
                f"decode leg's kv_transfer_params must carry the same transfer_secret as the prefill leg's (the "
                f"router passes prefill's response to decode unchanged, or the proxy gives both legs the secret it "
                f"minted)")
    if not hmac.compare_digest(proof, transfer_proof(secret, session, transfer_id)):
        return (f"transfer {transfer_id!r}: the registration's proof of the transfer_secret is wrong (decode got "
                f"another secret than prefill's request carries, or this is not the request's decode)")
    return ""


# ---- engine keys ---------------------------------------------------------------------------------------------------
# An engine id is a string from the engine's config: any token holder can claim it, at a rank the engine has not
# connected yet or before the engine itself connects. The ranks of one vLLM engine share an Ed25519 key, minted where
# they all see it (connector.vllm: the scheduler side mints it and ships it to every worker in the connector
# metadata); each connection proves it with a signature of its own transcript (both nonces), so prefill knows the
# engine as (engine id, key) and no other peer can be it. A signature rather than an HMAC: prefill never learns the
# key, so a token holder posing as a prefill (which sees decode's Hello and Auth) cannot become the engine either.

ENGINE_KEY_BYTES = 32


def new_engine_key() -> bytes:
    """A fresh engine key (an Ed25519 private key's 32 bytes): one per engine process start."""
    return secrets.token_bytes(ENGINE_KEY_BYTES)


def engine_public_key(key: bytes) -> bytes:
    """What an engine's Hello carries for `key`."""
    return Ed25519PrivateKey.from_private_bytes(key).public_key().public_bytes_raw()


def _signed(client: Hello, server: Hello, claim: Hello) -> bytes:
    """What an engine key signs: the transcript (both nonces) and the identity decode claims in its Auth."""
    return b"engine\x00" + transcript(client, server) + hashlib.sha256(encode_body(identity(claim))).digest()


def engine_signature(key: bytes, client: Hello, server: Hello, claim: Hello) -> bytes:
    """`key`'s signature of this connection (`client`: decode's opening) and of `claim`, who decode says it is."""
    return Ed25519PrivateKey.from_private_bytes(key).sign(_signed(client, server, claim))


def check_engine_signature(client: Hello, server: Hello, auth: Auth) -> None:
    """Raises ControlError unless `auth` carries the signature of the transcript and its identity by the identity's
    `engine_key` (nothing to check for a peer without one). `client`: decode's opening."""
    claim = auth.hello
    if claim is None or not claim.engine_key:
        return
    who = f"decode engine {claim.engine_id!r} rank ({claim.pp_rank},{claim.tp_rank})"
    try:
        Ed25519PublicKey.from_public_bytes(claim.engine_key).verify(auth.engine_signature,
                                                                    _signed(client, server, claim))
    except (InvalidSignature, ValueError):
        raise ControlError(f"{who} names an engine_key it does not prove (its Auth carries no valid signature by "
                           f"it): a key copied from another rank's Hello is not that engine") from None


def engine_name(hello: Hello) -> str:
    """The engine a peer is known by here: its engine id, with a fingerprint of its engine key when it has one (so
    two peers that claim one engine id with different keys are two engines, and neither acts for the other)."""
    if not hello.engine_key:
        return hello.engine_id
    return f"{hello.engine_id}#{hashlib.sha256(hello.engine_key).hexdigest()[:12]}"


# ---- prefill keys ---------------------------------------------------------------------------------------------------
# Decode hands its memory (NIXL agent metadata and every region) to the prefill it connects to, and NIXL lets that
# agent WRITE anywhere in what decode registered, other requests' blocks included. The token cannot say "this peer
# is a prefill": every engine holds it, and a decode connects wherever a request's kv_transfer_params point (a client
# of decode's HTTP API chooses them). A prefill key can: an Ed25519 key that only prefill nodes hold
# (`prefill_key_file`), whose public half decode is given (`trusted_prefill_keys`). Prefill's Hello carries the
# public key (`engine_key`) and a signature of the transcript (`signature`, both nonces: a Hello replayed from
# another connection fails); a decode with trusted keys checks both before a byte about its memory leaves.

KEY_TEXT_CHARS = 2 * ENGINE_KEY_BYTES
"""An Ed25519 key (private or public) as text: 64 hex digits (`python -m connector keygen`)."""


def key_from_text(text: str, what: str) -> bytes:
    """The 32 bytes of a key written as 64 hex digits (surrounding whitespace dropped); ValueError naming `what`."""
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != ENGINE_KEY_BYTES:
        raise ValueError(f"{what} is not an Ed25519 key of {KEY_TEXT_CHARS} hex digits (got {len(text)} characters; "
                         f"`python -m connector keygen FILE` writes one)")
    return key


def key_fingerprint(public_key: bytes) -> str:
    """How a public key is named in messages: its first 16 hex digits."""
    return public_key.hex()[:16]


def prefill_signature(key: bytes, client: Hello, server: Hello) -> bytes:
    """Prefill's signature of the transcript (its Hello carrying the public half of `key` as `engine_key`)."""
    return Ed25519PrivateKey.from_private_bytes(key).sign(b"prefill-key\x00" + transcript(client, server))


def check_prefill_key(trusted: frozenset[bytes], client: Hello, server: Hello) -> None:
    """Decode's check of prefill's key: nothing to check without `trusted` keys; else ControlError unless prefill's
    Hello names one of them and carries its signature of this connection's transcript."""
    if not trusted:
        return
    if not server.engine_key:
        raise ControlError("this decode trusts only prefills with a key in trusted_prefill_keys, and this prefill has "
                           "none (prefill_key_file unset there, or an older connector): set prefill_key_file on "
                           "prefill; nothing about decode's memory was sent")
    if server.engine_key not in trusted:
        raise ControlError(f"prefill's key {key_fingerprint(server.engine_key)} is not in decode's "
                           f"trusted_prefill_keys ({len(trusted)} key(s)): add the public key `python -m connector "
                           f"keygen --public FILE` prints for its prefill_key_file, or this is not a prefill of this "
                           f"cluster; nothing about decode's memory was sent")
    try:
        Ed25519PublicKey.from_public_bytes(server.engine_key).verify(server.signature,
                                                                     b"prefill-key\x00" + transcript(client, server))
    except (InvalidSignature, ValueError):
        raise ControlError(f"prefill names the trusted key {key_fingerprint(server.engine_key)} but does not prove "
                           f"it (no valid signature of this connection's handshake): a key copied from another "
                           f"prefill's Hello is not that prefill; nothing about decode's memory was sent") from None
