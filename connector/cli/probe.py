"""What `doctor` asks the network: whether a side-channel address is a SparseKVConnector side channel (a handshake
that stops before anything is registered), whether an engine's HTTP server is up and runs the connector, and
whether a local port is free. Every call is bounded by its timeout and closes what it opened."""

from __future__ import annotations

import asyncio
import errno
import socket
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass

import msgspec

from connector.core.errors import ControlError, FrameError
from connector.protocol.auth import check_server_proof, identity, new_nonce, opening
from connector.protocol.handshake import check_hello
from connector.protocol.messages import HANDSHAKE_MAX_FRAME_BYTES, Hello, Reject, encode_frame
from connector.transport.handshake import read_frame

DOCTOR_ENGINE = "sparse-kv-connector-doctor"
"""The engine id the probe introduces itself with (what prefill's log names)."""
GOODBYE = "sparse-kv-connector doctor: handshake check only, nothing registered"


@dataclass(frozen=True)
class SideChannelAnswer:
    kind: str
    """"connector" (our handshake answered), "mismatch" (it answered for another model or version), "refused" (it
    answered Reject), "http" (an HTTP server), "closed",
    "silent", "unreachable", "tls" (a TLS failure), "other" (anything else)."""
    detail: str = ""
    """The peer's reason, or what went wrong."""
    auth: str = ""
    """With "connector": "ok", or why the token does not match (auth_token differs ...)."""


async def _probe(host: str, port: int, hello: Hello, token: str, timeout_s: float,
                 ssl_context: ssl.SSLContext | None) -> SideChannelAnswer:
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port, ssl=ssl_context,
                                                           server_hostname=host if ssl_context else None)
    except ssl.SSLError as exc:
        return SideChannelAnswer("tls", repr(exc))
    except (OSError, TimeoutError) as exc:
        return SideChannelAnswer("unreachable", repr(exc))
    try:
        async with asyncio.timeout(timeout_s):
            ours = opening(msgspec.structs.replace(identity(hello), nonce=new_nonce()))  # decode speaks second
            writer.write(encode_frame(ours))
            await writer.drain()
            reply = await read_frame(reader, HANDSHAKE_MAX_FRAME_BYTES)
            if isinstance(reply, Reject):
                return SideChannelAnswer("refused", reply.reason)
            if not isinstance(reply, Hello):
                return SideChannelAnswer("other", f"answered {type(reply).__name__} to a Hello")
            try:
                check_server_proof(token, ours, reply)
                auth = "ok"
            except ControlError as exc:
                auth = str(exc)
            writer.write(encode_frame(Reject(GOODBYE)))
            try:
                check_hello(reply, hello)  # (decode compares the models: prefill answers any opening)
            except ControlError as exc:
                await writer.drain()
                return SideChannelAnswer("mismatch", str(exc), auth)  # prefill logs one line naming the doctor, and forgets us
            await writer.drain()
            return SideChannelAnswer("connector", f"{reply.role} engine {reply.engine_id}", auth)
    except FrameError as exc:
        return SideChannelAnswer("http" if "HTTP" in str(exc) else "other", str(exc))
    except asyncio.IncompleteReadError:
        return SideChannelAnswer("closed", "closed the connection without answering the Hello")
    except TimeoutError:
        return SideChannelAnswer("silent", f"no answer to a Hello within {timeout_s:g} s")
    except (OSError, ControlError) as exc:
        return SideChannelAnswer("other", repr(exc))
    finally:
        writer.close()


def probe_side_channel(host: str, port: int, hello: Hello, token: str, timeout_s: float = 5.0,
                       ssl_context: ssl.SSLContext | None = None) -> SideChannelAnswer:
    """Open a side-channel handshake as decode would, check prefill's proof against `token`, and leave (a Reject in
    place of Auth: no memory is sent, nothing is registered)."""
    return asyncio.run(_probe(host, port, hello, token, timeout_s, ssl_context))


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; status 0 and the reason when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read(1 << 20).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return 0, str(getattr(exc, "reason", exc))


def port_state(host: str, port: int) -> str:
    """"free", "in use", "not local" (host is no address of this machine) or the bind error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return "free"
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "in use"
            if exc.errno == errno.EADDRNOTAVAIL:
                return "not local"
            return exc.strerror or str(exc)
