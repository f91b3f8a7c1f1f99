"""Side-channel messages and their wire format. Pure data and codec; no sockets (connector.transport.control).

Frame on the wire:

    +----------------+------------------+--------------------------------+
    | u32 big-endian | u16 big-endian   | msgpack of one `Message`       |
    | body length    | protocol version | (tagged union, key "type")     |
    +----------------+------------------+--------------------------------+

The 6-byte header is read first, so the length is checked against the receiver's limit and the version against
PROTOCOL_VERSION before a single body byte is read. `Hello` also carries `version` so the application sees it.

Handshake (connector.protocol.auth has the proofs, connector.transport.control the sockets):

    decode  -> prefill   Hello    an opening: role, model and a fresh nonce, nothing that says which decode
                                  (no engine id, agent name, ranks, engine key or transfer id; no memory)
    prefill -> decode    Hello    who I am + a fresh nonce + proof (HMAC of the transcript, when a token is set)
                                  + its prefill key's signature (when it has one)
    decode  -> prefill   Auth     who I am (`hello`), proof (HMAC of the transcript and of this message) + decode's
                                  NIXL metadata, regions and staging buffer: sent only once prefill has proven
                                  the token (and, for a decode with trusted_prefill_keys, a trusted key)
    prefill -> decode    Welcome  (or Reject): the connection is open

Decode speaks second: whoever a request's kv_transfer_params point decode at learns only that a decode of this model
called, until it has proven what decode requires of a prefill.

Static bounds (string and list lengths) are part of the types, so msgspec refuses an oversized field while
decoding; what depends on the engine (layout sizes, block counts) is checked in connector.protocol.handshake and
connector.engine.
"""

from __future__ import annotations

import struct
from typing import Annotated, Literal, Union

import msgspec
import numpy as np
from msgspec import Meta

from connector.core.errors import FrameError
from connector.core.layout import Region
from connector.core.untrusted import ID_PATTERN, shown_text

PROTOCOL_VERSION = 10
"""Wire protocol version; a frame or Hello with any other version is rejected.

Bump it for any change an older peer would misread, and add the version's line to its history in
docs/internals.md ("Protocol versions"): what changed and what a peer one version older would do with it.
"""
DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024
"""Largest body a receiver accepts after the handshake unless configured otherwise. The largest real messages are
far below it: a Register for 1M tokens in 16-token blocks is 0.25 MB per KV-cache group (block ids packed, 4
bytes each), a Scatter for a 16 MiB slot of 4 KiB ranges 64 KB. (A decoded list of integers would take ~8x its
size in memory: the large ones travel packed.)"""
HANDSHAKE_MAX_FRAME_BYTES = 1024 * 1024
"""Largest body accepted before the peer has authenticated (Hello, Auth). Auth is the large one: a NIXL metadata
blob and one Region per (pool, layer), some tens of KB for a 60-layer model."""
NONCE_BYTES = 32
"""Length of each side's handshake nonce and of an HMAC-SHA256 proof."""

MAX_ID = 256
"""Longest engine id, agent name or fingerprint (characters)."""
MAX_TRANSFER_ID = 512
"""Longest transfer id (vLLM request ids are ~40-60 characters)."""
MAX_LIST = 1 << 16
"""Longest list of regions, stages, layers, block-id groups' ids or heartbeat ids."""
MAX_GROUPS = 64
"""Most KV-cache groups a registration may name."""
MAX_BLOCKS = 1 << 20
"""Most block ids in one group of a registration (prefill checks the real bound: the registered cache)."""
BLOCK_ID = np.dtype("<i4")
"""A decode block id on the wire (Register.block_ids): a cache has far fewer than 2**31 blocks."""

EngineName = Annotated[str, Meta(max_length=MAX_ID, pattern=ID_PATTERN)]
TransferId = Annotated[str, Meta(max_length=MAX_TRANSFER_ID, pattern=ID_PATTERN)]
"""Ids hold no control, separator or bidi character (connector.core.untrusted.ID_PATTERN): a frame with one is
refused as a bad frame, so no peer's id can forge or reorder a log line (issue 33)."""
Reason = str
"""Free text (exception messages, unbounded but for the frame limit: text does not grow when decoded)."""
Count = Annotated[int, Meta(ge=0)]
Proof = Annotated[bytes, Meta(max_length=NONCE_BYTES)]
BlockIdGroup = Annotated[bytes, Meta(max_length=BLOCK_ID.itemsize * MAX_BLOCKS)]
"""One KV-cache group's decode block ids, packed as BLOCK_ID (`pack_block_ids`, `Register.groups`)."""
HEADER = struct.Struct(">IH")
"""Frame header: body length in bytes, protocol version."""
HTTP_ANSWER = b"HTTP"
"""How an HTTP server's answer starts: read as a frame header, a 1,213,486,160-byte length."""
HTTP_REQUESTS = (b"GET ", b"POST", b"HEAD", b"PUT ", b"OPTI", b"DELE", b"PATC")
"""How HTTP requests start (each a length far over any limit when read as a header)."""

Role = Literal["prefill", "decode"]
PoolName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.:~@#-]{1,120}\Z")]
MAX_POOLS = 64
"""Pools a layout may have: the three first ones and each cache of its own (DeepSeek-V4: 7 more)."""
"""connector.core.layout.POOL_NAME, as a wire type: the three first pools or a cache's own (`self_attn.swa_cache`)."""


class PoolLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One pool of the model's layout (connector.core.layout.PoolSpec) on the wire."""

    name: PoolName
    layers: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_LIST)]
    num_heads: Count
    bytes_per_token_per_head: Count
    num_parts: Count
    sharded: bool
    block_size: Count = 0
    bytes_per_block_per_head: Count = 0
    per_request: bool = False
    same_tp: bool = False
    spec: Annotated[str, Meta(max_length=64, pattern=ID_PATTERN)] = ""


class Hello(msgspec.Struct, frozen=True, tag="hello", tag_field="type"):
    """First frame each way: who the rank is. On the wire it never carries memory (the fields from `agent_metadata`
    to `staging_bytes` are empty): decode's go in `Auth` after prefill proved the token, prefill's are never sent.
    In memory, a peer's Hello is completed with its Auth (`connector.protocol.auth.with_memory`)."""

    role: Role
    engine_id: EngineName
    pp_rank: Count
    tp_rank: Count
    pp_size: Count
    tp_size: Count
    fingerprint: EngineName
    """`ModelLayout.fingerprint()`: both sides must agree on it exactly."""
    block_size: Count
    """Tokens per KV-cache block."""
    agent_name: EngineName
    """NIXL agent name."""
    layout: Annotated[list[PoolLayout], Meta(max_length=MAX_POOLS)] = []
    """The layout the fingerprint is of: what a mismatch is explained from."""
    num_layers: Count = 0
    agent_metadata: bytes = b""
    """NIXL agent metadata (opaque; load with `add_remote_agent`, never unpickle)."""
    regions: Annotated[list[Region], Meta(max_length=MAX_LIST)] = []
    """Every (pool, global layer) this rank holds, with addresses."""
    stages: Annotated[list[tuple[int, int]], Meta(max_length=MAX_LIST)] = []
    """This side's PP stages, [start, end) global layers each: the peer builds its transfer plan from it."""
    staging_addr: Count = 0
    """Base address of this rank's NIXL-registered staging buffer (connector.engine.staging); 0 = it has none.
    Prefill reads decode's to aim its staged chunks; decode never reads prefill's."""
    staging_device: Count = 0
    """Device index of that buffer."""
    staging_bytes: Count = 0
    """Size of that buffer: prefill refuses a registration whose staging slot lies outside it."""
    nonce: Proof = b""
    """NONCE_BYTES fresh random bytes, new for every connection (what makes a captured handshake useless)."""
    proof: Proof = b""
    """Prefill's: HMAC-SHA256 of the transcript under the shared token (connector.protocol.auth); empty without one."""
    version: int = PROTOCOL_VERSION
    null_block: Annotated[int, Meta(ge=-1)] = -1
    """The block id this rank keeps empty (vLLM's null block 0, where a sliding window left tokens behind): decode's
    is not written, prefill's is never read; -1: none."""
    pool_block_sizes: Annotated[list[tuple[PoolName, Annotated[int, Meta(ge=1)]]], Meta(max_length=MAX_POOLS)] = []
    """Tokens per block of each paged pool of this rank (connector.core.block_views.pool_block_sizes): the two sides
    may differ where one is a multiple of the other. A decode rank's regions say the same; a prefill rank sends no
    regions, so decode reads its sizes here."""
    engine_key: Annotated[bytes, Meta(max_length=32)] = b""
    """Decode: the Ed25519 public key every rank of its engine shares (b"": none). Proven by Auth's
    `engine_signature`; part of the identity prefill knows the engine by (connector.protocol.auth.engine_name).
    Prefill: the public half of its prefill key (prefill_key_file; b"": none), proven by `signature`."""
    signature: Annotated[bytes, Meta(max_length=64)] = b""
    """Prefill: Ed25519 signature of the transcript by its prefill key (connector.protocol.auth.prefill_signature);
    a decode with trusted_prefill_keys sends its memory only to a prefill that proves one of them."""
    for_transfer: TransferId = ""
    """Decode: the transfer that made it open this connection ("" for none). A prefill that refuses the handshake
    (another model, another token) gives that transfer up at once instead of holding its KV for the lease. The
    claim is not authenticated, so it counts only as an early abort does (connector.engine.ownership)."""
    lane: Proof = b""
    """Decode: a pseudonym of its rank (connector.protocol.auth.lane_tag: an HMAC of its engine id and ranks under the
    token) that its opening carries, so a prefill it authenticated to before gives a reconnect its own admission
    lane before it knows who is calling, while a listener learns no name."""


class Auth(msgspec.Struct, frozen=True, tag="auth", tag_field="type"):
    """Decode -> prefill, once prefill's Hello proved the token: decode's proof and its memory."""

    proof: Proof = b""
    """HMAC-SHA256 of the transcript and of this message's other fields under the token; empty without one."""
    agent_metadata: Annotated[bytes, Meta(max_length=HANDSHAKE_MAX_FRAME_BYTES)] = b""
    regions: Annotated[list[Region], Meta(max_length=MAX_LIST)] = []
    staging_addr: Count = 0
    staging_device: Count = 0
    staging_bytes: Count = 0
    engine_signature: Annotated[bytes, Meta(max_length=64)] = b""
    """Ed25519 signature of the transcript and of `hello` by the key of `hello.engine_key` (empty without one): a
    key copied from another rank's Hello does not make its holder that engine."""
    hello: Hello | None = None
    """Who decode is (its Hello as on the wire, no memory, with its opening's nonce): told only here, once prefill
    proved what decode requires (protocol 8). None is refused."""


class Welcome(msgspec.Struct, frozen=True, tag="welcome", tag_field="type"):
    """Prefill -> decode: the handshake passed every check; the connection is open."""


class Reject(msgspec.Struct, frozen=True, tag="reject", tag_field="type"):
    """The server refuses a handshake; the connection closes after it. (Also decode's answer in place of Auth when
    it refuses prefill's Hello.)"""

    reason: Reason
    transfer_hint: Proof = b""
    """Decode refusing prefill's Hello: the transfer it connected for, as connector.protocol.auth.transfer_hint (a
    digest bound to this connection's nonces), so the prefill that holds it frees its KV at once while a listener
    learns no transfer id. Empty otherwise."""


class Register(msgspec.Struct, frozen=True, tag="register", tag_field="type"):
    """Decode -> prefill: write request `transfer_id` into these blocks."""

    transfer_id: TransferId
    dst_pp: int
    dst_tp: int
    block_ids: Annotated[list[BlockIdGroup], Meta(max_length=MAX_GROUPS)]
    """Decode block ids, one packed group per KV-cache group (lists of ints given here are packed on creation;
    `groups` reads them as arrays)."""
    first_token: int
    """First prompt token decode wants (its prefix-cache hit count, in tokens)."""
    num_tokens: int
    """Prompt length in tokens."""
    layers: Annotated[list[int], Meta(max_length=MAX_LIST)] = []
    """Global layers decode expects from this prefill rank (its plan); prefill refuses layers it does not hold."""
    staging_offset: int = 0
    staging_bytes: int = 0
    """The slot of decode's staging buffer this prefill rank may stage through (0 bytes: write directly)."""
    after_prefill: bool = False
    """Decode learned of the transfer from prefill's response (sequential flow): prefill must already know it,
    so an unknown id is refused at once (restarted prefill, wrong id) instead of parked."""
    checksum: bool = False
    """Decode verifies what it receives (`kv_checksum`): prefill sends its digests (Checksums) before Complete."""
    proof: Proof = b""
    """Decode proves it holds the transfer's secret (the `transfer_secret` of its kv_transfer_params):
    connector.protocol.auth.transfer_proof, never the secret itself; empty when decode got none."""

    def __post_init__(self) -> None:
        # Called on creation and on decoding. Decoded groups are bytes already: only their length is checked (a
        # ValueError here fails the frame's decoding, which the connection answers with a Reject).
        if all(type(g) is bytes for g in self.block_ids):
            for g, packed in enumerate(self.block_ids):
                if len(packed) % BLOCK_ID.itemsize:
                    raise ValueError(f"Register.block_ids[{g}] has {len(packed)} bytes, not a whole number of "
                                     f"{BLOCK_ID.itemsize}-byte block ids")
        else:
            msgspec.structs.force_setattr(self, "block_ids", [pack_block_ids(g) for g in self.block_ids])

    @property
    def groups(self) -> list[np.ndarray]:
        """The block ids of each group, as read-only BLOCK_ID arrays over the packed bytes (no copy)."""
        return [np.frombuffer(g, dtype=BLOCK_ID) for g in self.block_ids]


def pack_block_ids(ids) -> bytes:
    """One group's block ids (ints, an array, or bytes packed already) as BLOCK_ID bytes."""
    if isinstance(ids, (bytes, bytearray, memoryview)):
        return bytes(ids)
    arr = np.asarray(ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"block ids must be a flat list per group, got shape {arr.shape}")
    limits = np.iinfo(BLOCK_ID)
    outside = arr[(arr < limits.min) | (arr > limits.max)]
    if outside.size:
        raise ValueError(f"block ids {outside[:8].tolist()} do not fit a 32-bit block id")
    return arr.astype(BLOCK_ID).tobytes()


class RegisterAck(msgspec.Struct, frozen=True, tag="register_ack", tag_field="type"):
    transfer_id: TransferId


class RegisterError(msgspec.Struct, frozen=True, tag="register_error", tag_field="type"):
    transfer_id: TransferId
    reason: Reason


class Complete(msgspec.Struct, frozen=True, tag="complete", tag_field="type"):
    """Prefill -> decode: rank (src_pp, src_tp) finished every WRITE of `transfer_id`."""

    transfer_id: TransferId
    src_pp: int
    src_tp: int
    bytes_written: int
    descriptors: int
    """Number of descriptors (byte ranges) this rank moved for this transfer."""
    staged_chunks: int = 0
    """How many of those went through staging, as this many gathered chunks (one NIXL descriptor each)."""
    bytes_by_pool: Annotated[dict[PoolName, Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_POOLS)] = {}
    """`bytes_written` split by pool (added within version 3: an older peer sends none, decode then counts none)."""


class RouteDigests(msgspec.Struct, frozen=True, array_like=True):
    """One route's digests: one little-endian uint64 per decode block it wrote, in decode's block order
    (connector.core.checksums)."""

    pool: PoolName
    layer: int
    heads: tuple[int, int]
    digests: bytes


class Checksums(msgspec.Struct, frozen=True, tag="checksums", tag_field="type"):
    """Prefill -> decode, before Complete and only when the Register asked: what rank (src_pp, src_tp) sent, per
    route and block. A transfer's digests may come in several of these (each well under the frame limit)."""

    transfer_id: TransferId
    src_pp: int
    src_tp: int
    routes: Annotated[list[RouteDigests], Meta(max_length=MAX_LIST)]


class Abort(msgspec.Struct, frozen=True, tag="abort", tag_field="type"):
    """Either side: drop `transfer_id` (free kept blocks / stop waiting)."""

    transfer_id: TransferId
    reason: Reason
    proof: Proof = b""
    """Decode -> prefill: as Register's, when decode holds the transfer's secret (an Abort from a decode rank that
    has no destination of the transfer on its connection counts only with it)."""


class Stopped(msgspec.Struct, frozen=True, tag="stopped", tag_field="type"):
    """Prefill -> decode, answering an Abort: rank (src_pp, src_tp) will write nothing more for `transfer_id` and
    every WRITE it posted has completed, so decode may free or reuse the blocks."""

    transfer_id: TransferId
    src_pp: int
    src_tp: int


class StagedRows(msgspec.Struct, frozen=True, array_like=True):
    """Rows of one region part in a staged chunk (connector.core.staging_ranges.Rows, decode's side): row k is
    `row_bytes` long and goes to `addr + blocks[k] * stride`."""

    addr: Count
    stride: Count
    row_bytes: Count
    blocks: Annotated[bytes, Meta(max_length=8 * MAX_BLOCKS)]
    """Decode block ids, packed little-endian int64."""


class Scatter(msgspec.Struct, frozen=True, tag="scatter", tag_field="type"):
    """Prefill -> decode, sent once the chunk's WRITE has completed: `nbytes` at `slot_offset` of the staging area
    decode gave this connection hold chunk `seq` of `transfer_id`, its `rows` packed back to back in order; copy
    them to their blocks and answer Scattered."""

    transfer_id: TransferId
    seq: Count
    nbytes: Count
    rows: Annotated[list[StagedRows], Meta(max_length=MAX_LIST)] = []
    slot_offset: Count = 0


class Scattered(msgspec.Struct, frozen=True, tag="scattered", tag_field="type"):
    """Decode -> prefill: chunk `seq` is in place (ok) or was refused (nothing written); its slot is free again
    (prefill's credit for it comes back)."""

    transfer_id: TransferId
    seq: int
    ok: bool
    reason: Reason = ""


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat", tag_field="type"):
    """Liveness. Decode lists the transfers it still wants, which extends their leases on prefill.
    An empty Heartbeat is liveness only and is not delivered to the application."""

    transfer_ids: Annotated[list[TransferId], Meta(max_length=MAX_LIST)] = []


class Error(msgspec.Struct, frozen=True, tag="error", tag_field="type"):
    """Generic failure report (bad frame, handler failure) while the connection can still speak."""

    reason: Reason


Message = Union[Hello, Auth, Welcome, Reject, Register, RegisterAck, RegisterError, Checksums, Complete, Abort, Stopped,
                Scatter, Scattered, Heartbeat, Error]
MESSAGE_TYPES: tuple[type, ...] = Message.__args__  # type: ignore[attr-defined]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_body(msg: Message) -> bytes:
    """msgpack of one message, no header."""
    return _encoder.encode(msg)


def decode_body(body: bytes) -> Message:
    """Inverse of `encode_body`. Raises FrameError naming what is wrong, and only FrameError: the bytes are the
    peer's (before authentication anyone's), so whatever the decoder makes of them is the peer's fault, never a bug
    to log with a traceback."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:  # msgspec names a refused tag raw (newlines and all): shown, bounded
        why = str(exc).replace(f"matching regex {ID_PATTERN!r}", "without control, separator or bidi characters")
        raise FrameError(f"invalid message: {shown_text(why)}") from None
    except msgspec.DecodeError as exc:
        raise FrameError(f"malformed msgpack: {shown_text(exc)}") from None
    except RecursionError:  # msgspec guards its recursion with the interpreter's limit: a value nested ~1000 deep
        raise FrameError("message nested too deeply (no message of this protocol nests more than a few levels)") \
            from None
    except Exception as exc:  # noqa: BLE001 - anything else the decoder raises on hostile bytes
        raise FrameError(f"undecodable message: {type(exc).__name__}: {shown_text(exc, 500)}") from None


def encode_frame(msg: Message, *, version: int = PROTOCOL_VERSION) -> bytes:
    """Header plus body, ready to write."""
    body = _encoder.encode(msg)
    return HEADER.pack(len(body), version) + body


def check_header(header: bytes, max_frame_bytes: int) -> int:
    """Validate a 6-byte header; return the body length. Raises FrameError for size or version."""
    length, version = HEADER.unpack(header)
    if length > max_frame_bytes:
        size = f"read as a frame header, {length} bytes, which exceeds the {max_frame_bytes}-byte limit"
        if header.startswith(HTTP_ANSWER):
            raise FrameError(f"the peer answered in HTTP ({size}): this address is an HTTP server (prefill's API "
                             f"port?), not a side channel: give decode prefill's side_channel_host:side_channel_port "
                             f"(the proxy's --prefill URL,HOST:SIDE_CHANNEL_PORT), not its HTTP port")
        if header.startswith(HTTP_REQUESTS):
            raise FrameError(f"the peer sent an HTTP request ({header[:4].decode()!r}..., {size}) to the side "
                             f"channel: something (a router, a health check, curl) is pointed at side_channel_port "
                             f"instead of the engine's HTTP port")
        raise FrameError(f"frame of {length} bytes exceeds the {max_frame_bytes}-byte limit")
    if version != PROTOCOL_VERSION:
        raise FrameError(f"frame has protocol version {version}, this side speaks {PROTOCOL_VERSION}: run the same "
                         f"sparse-kv-connector version on prefill and decode")
    return length


def decode_frame(data: bytes, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """Decode one whole frame (header and body) from bytes; the body must be exactly the announced length."""
    if len(data) < HEADER.size:
        raise FrameError(f"frame of {len(data)} bytes is shorter than the {HEADER.size}-byte header")
    length = check_header(data[: HEADER.size], max_frame_bytes)
    if len(data) - HEADER.size != length:
        raise FrameError(f"frame announces {length} body bytes but has {len(data) - HEADER.size}")
    return decode_body(data[HEADER.size:])
