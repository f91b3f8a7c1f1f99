"""Side-channel messages and their wire format. Pure data and codec; no sockets (connector.transport.control).

Frame on the wire:

    +----------------+------------------+--------------------------------+
    | u32 big-endian | u16 big-endian   | msgpack of one `Message`       |
    | body length    | protocol version | (tagged union, key "type")     |
    +----------------+------------------+--------------------------------+

The 6-byte header is read first, so the length is checked against the receiver's limit and the version against
PROTOCOL_VERSION before a single body byte is read. `Hello` also carries `version` so the application sees it.
"""

from __future__ import annotations

import struct
from typing import Literal, Union

import msgspec

from connector.core.errors import FrameError
from connector.core.layout import Region

PROTOCOL_VERSION = 2
"""Wire protocol version; a frame or Hello with any other version is rejected.

History (one line per version; bump it for any change an older peer would misread):
  1  Hello, Reject, Register, RegisterAck, RegisterError, Complete, Abort, Stopped, Heartbeat, Error. Staged transfers
     (Scatter, Scattered, and the staging fields of Hello, Register and Complete) came within version 1: the fields
     default to "no staging", and a prefill rank sends Scatter only to a decode rank whose Hello offered a buffer.
  2  Scatter names its rows block-wise (`rows`, replacing the address pairs of `destinations`) and where in the
     connection's staging area the chunk lies (`slot_offset`), and is sent once the chunk's WRITE completed, so
     prefill keeps a ring of chunks in flight; Register's staging fields give a connection an area, not one slot.
     A version-1 peer would fail to decode such a Scatter mid-transfer: it is refused at the handshake instead.
"""
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
"""Largest body a receiver accepts unless configured otherwise."""
HEADER = struct.Struct(">IH")
"""Frame header: body length in bytes, protocol version."""

Role = Literal["prefill", "decode"]


class Hello(msgspec.Struct, frozen=True, tag="hello", tag_field="type"):
    """First frame each way. The connecting side sends its identity; the server answers with its own (auth_token "")."""

    role: Role
    engine_id: str
    pp_rank: int
    tp_rank: int
    pp_size: int
    tp_size: int
    fingerprint: str
    """`ModelLayout.fingerprint()`: both sides must agree on it exactly."""
    block_size: int
    """Tokens per KV-cache block."""
    agent_name: str
    """NIXL agent name."""
    agent_metadata: bytes = b""
    """NIXL agent metadata (opaque; load with `add_remote_agent`, never unpickle)."""
    regions: list[Region] = []
    """Every (pool, global layer) this rank holds, with addresses."""
    stages: list[tuple[int, int]] = []
    """This side's PP stages, [start, end) global layers each: the peer builds its transfer plan from it."""
    auth_token: str = ""
    """Shared secret the server checks; empty when the server runs without auth."""
    staging_addr: int = 0
    """Base address of this rank's NIXL-registered staging buffer (connector.engine.staging); 0 = it has none.
    Prefill reads decode's to aim its staged chunks; decode never reads prefill's."""
    staging_device: int = 0
    """Device index of that buffer."""
    version: int = PROTOCOL_VERSION


class Reject(msgspec.Struct, frozen=True, tag="reject", tag_field="type"):
    """The server refuses a handshake; the connection closes after it."""

    reason: str


class Register(msgspec.Struct, frozen=True, tag="register", tag_field="type"):
    """Decode -> prefill: write request `transfer_id` into these blocks."""

    transfer_id: str
    dst_pp: int
    dst_tp: int
    block_ids: list[list[int]]
    """Decode block ids, one list per KV-cache group."""
    first_token: int
    """First prompt token decode wants (its prefix-cache hit count, in tokens)."""
    num_tokens: int
    """Prompt length in tokens."""
    layers: list[int] = []
    """Global layers decode expects from this prefill rank (its plan); prefill refuses layers it does not hold."""
    staging_offset: int = 0
    staging_bytes: int = 0
    """The slot of decode's staging buffer this prefill rank may stage through (0 bytes: write directly)."""
    after_prefill: bool = False
    """Decode learned of the transfer from prefill's response (sequential flow): prefill must already know it,
    so an unknown id is refused at once (restarted prefill, wrong id) instead of parked."""


class RegisterAck(msgspec.Struct, frozen=True, tag="register_ack", tag_field="type"):
    transfer_id: str


class RegisterError(msgspec.Struct, frozen=True, tag="register_error", tag_field="type"):
    transfer_id: str
    reason: str


class Complete(msgspec.Struct, frozen=True, tag="complete", tag_field="type"):
    """Prefill -> decode: rank (src_pp, src_tp) finished every WRITE of `transfer_id`."""

    transfer_id: str
    src_pp: int
    src_tp: int
    bytes_written: int
    descriptors: int
    """Number of descriptors (byte ranges) this rank moved for this transfer."""
    staged_chunks: int = 0
    """How many of those went through staging, as this many gathered chunks (one NIXL descriptor each)."""


class Abort(msgspec.Struct, frozen=True, tag="abort", tag_field="type"):
    """Either side: drop `transfer_id` (free kept blocks / stop waiting)."""

    transfer_id: str
    reason: str


class Stopped(msgspec.Struct, frozen=True, tag="stopped", tag_field="type"):
    """Prefill -> decode, answering an Abort: rank (src_pp, src_tp) will write nothing more for `transfer_id` and
    every WRITE it posted has completed, so decode may free or reuse the blocks."""

    transfer_id: str
    src_pp: int
    src_tp: int


class StagedRows(msgspec.Struct, frozen=True, array_like=True):
    """Rows of one region part in a staged chunk (connector.core.staging_ranges.Rows, decode's side): row k is
    `row_bytes` long and goes to `addr + blocks[k] * stride`."""

    addr: int
    stride: int
    row_bytes: int
    blocks: bytes
    """Decode block ids, packed little-endian int64."""


class Scatter(msgspec.Struct, frozen=True, tag="scatter", tag_field="type"):
    """Prefill -> decode, sent once the chunk's WRITE has completed: `nbytes` at `slot_offset` of the staging area
    decode gave this connection hold chunk `seq` of `transfer_id`, its `rows` packed back to back in order; copy
    them to their blocks and answer Scattered."""

    transfer_id: str
    seq: int
    nbytes: int
    rows: list[StagedRows] = []
    slot_offset: int = 0


class Scattered(msgspec.Struct, frozen=True, tag="scattered", tag_field="type"):
    """Decode -> prefill: chunk `seq` is in place (ok) or was refused (nothing written); its slot is free again
    (prefill's credit for it comes back)."""

    transfer_id: str
    seq: int
    ok: bool
    reason: str = ""


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat", tag_field="type"):
    """Liveness. Decode lists the transfers it still wants, which extends their leases on prefill.
    An empty Heartbeat is liveness only and is not delivered to the application."""

    transfer_ids: list[str] = []


class Error(msgspec.Struct, frozen=True, tag="error", tag_field="type"):
    """Generic failure report (bad frame, handler failure) while the connection can still speak."""

    reason: str


Message = Union[Hello, Reject, Register, RegisterAck, RegisterError, Complete, Abort, Stopped, Scatter, Scattered,
                Heartbeat, Error]
MESSAGE_TYPES: tuple[type, ...] = Message.__args__  # type: ignore[attr-defined]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_body(msg: Message) -> bytes:
    """msgpack of one message, no header."""
    return _encoder.encode(msg)


def decode_body(body: bytes) -> Message:
    """Inverse of `encode_body`. Raises FrameError naming what is wrong."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise FrameError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise FrameError(f"malformed msgpack: {exc}") from None


def encode_frame(msg: Message, *, version: int = PROTOCOL_VERSION) -> bytes:
    """Header plus body, ready to write."""
    body = _encoder.encode(msg)
    return HEADER.pack(len(body), version) + body


def check_header(header: bytes, max_frame_bytes: int) -> int:
    """Validate a 6-byte header; return the body length. Raises FrameError for size or version."""
    length, version = HEADER.unpack(header)
    if length > max_frame_bytes:
        raise FrameError(f"frame of {length} bytes exceeds the {max_frame_bytes}-byte limit")
    if version != PROTOCOL_VERSION:
        raise FrameError(f"frame has protocol version {version}, this side speaks {PROTOCOL_VERSION}")
    return length


def decode_frame(data: bytes, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """Decode one whole frame (header and body) from bytes; the body must be exactly the announced length."""
    if len(data) < HEADER.size:
        raise FrameError(f"frame of {len(data)} bytes is shorter than the {HEADER.size}-byte header")
    length = check_header(data[: HEADER.size], max_frame_bytes)
    if len(data) - HEADER.size != length:
        raise FrameError(f"frame announces {length} body bytes but has {len(data) - HEADER.size}")
    return decode_body(data[HEADER.size:])
