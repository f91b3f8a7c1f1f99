"""Every exception the connector raises, in one tree. Catch a branch, not a tuple of leaves.

    ConnectorError
      InputError         refused before anything moved: the input is wrong, the message names it and the fix
        LayoutError        a model or parallel layout that cannot be used (or two sides whose layouts differ)
        DescriptorError    block ids or heads that do not fit a region
        RegistrationError  a decode registration prefill refuses (the text goes back to decode)
        StagingError       a staged chunk decode refuses (the text goes back to prefill)
        ConfigError        a setting or request parameter that cannot be used
        CliError           bad command-line input (exit code 2)
        PeerRefused        a handshake the server refuses: an identity or agent already connected, a limit
      PeerError          the other side, or the path to it, failed: retrying against a healthy peer may work
        ControlError       the side channel: rejected handshake, closed or dead peer, timeout
          FrameError         a frame that cannot be accepted (too large, unknown version, malformed)
          Unreachable        no connection to the peer's address at all (refused, no route, timed out)
          PeerGaveUp         the client refused the server's Hello itself (its Reject in place of Auth)
        TransportError     a NIXL WRITE, post or peer operation
          WriteAbandoned     a WRITE given up on while NIXL still runs it (its memory is in use until `settled`)
        StagedWriteError   a staged chunk that did not land
        TransferFailed     a transfer decode gives up on (which prefill rank, and why)
        ServerError        a `vllm serve` process (sparse_kv_lab.pd) that would not start or died
        RequestFailed      an HTTP request to such a server that was answered with an error
      PlanError          a plan that breaks an invariant: a bug here, not bad input

Each leaf keeps its stdlib parent (ValueError for refused input, RuntimeError for failures, AssertionError for a
broken invariant), so code written against those keeps working.
"""

from __future__ import annotations


class ConnectorError(Exception):
    """Root of every exception this package raises on purpose."""


class InputError(ConnectorError):
    """Input refused before anything was written; the message names the value, where it came from and the fix."""


class PeerError(ConnectorError):
    """The peer, or the path to it, failed (closed, dead, timed out, or it refused what we sent)."""


class LayoutError(InputError, ValueError):
    """A model or parallel layout that cannot be used; the message names the value and the fix."""


class DescriptorError(InputError, ValueError):
    """Block ids or heads that do not fit a region; the message names them."""


class RegistrationError(InputError, ValueError):
    """A registration that is refused before anything is written; the text goes back to decode."""


class CapabilityError(RegistrationError):
    """A registration or abort did not prove the transfer's secret (`transfer_secret`)."""


class StagingError(InputError, ValueError):
    """A staged chunk that cannot be accepted; the text goes back to the sender."""


class ConfigError(InputError, ValueError):
    """A setting (kv_connector_extra_config) or request parameter (kv_transfer_params) that cannot be used."""


class CliError(InputError, ValueError):
    """Bad command-line input; printed as one line, exit code 2."""


class PeerRefused(InputError, ValueError):
    """A peer's handshake refused after its checks passed: its identity or NIXL agent is held by another live
    connection, or a limit; the text goes back to the peer."""


class ControlError(PeerError, RuntimeError):
    """Anything that goes wrong on the side channel: rejected handshake, closed or dead peer, bad frame, timeout."""


class FrameError(ControlError):
    """A frame that cannot be accepted (too large, unknown version, malformed msgpack, unknown message type)."""


class Unreachable(ControlError):
    """No connection to the peer's address could be opened (nothing listens, no route, timed out): the only failure
    that is "cannot reach"; a peer that answered and refused raises another ControlError, with its reason."""


class PeerGaveUp(ControlError):
    """The client refused the handshake itself, saying why (its Reject in place of Auth): nothing to answer."""


class Probed(ControlError):
    """The peer's first frame was a Reject: a probe asking what listens (examples/proxy.py's start-up check), not a
    decode. Refused like any handshake that is not a decode's, but logged at INFO: it is how a router checks an
    address before traffic, on the happy path."""


class AuthFailed(ControlError):
    """A side-channel peer's proof of the auth token is wrong (counted against its address and claimed identity)."""


class Unanswered(ControlError):
    """A handshake refused without an answer (an identity locked out after wrong proofs: no reply, no work)."""


class TransportError(PeerError, RuntimeError):
    """A transfer or peer operation failed. The message names the peer/transfer and the fix."""


class WriteAbandoned(TransportError):
    """A WRITE given up on (timeout) while NIXL still runs it. NIXL cannot cancel it: its source and destination
    memory stay in use until `settled` (an asyncio future) is done; free or reuse neither before."""

    def __init__(self, message: str, settled: object) -> None:
        super().__init__(message)
        self.settled = settled


class StagedWriteError(PeerError, RuntimeError):
    """A staged chunk that did not land (decode refused it, the connection closed, or it timed out)."""


class TransferFailed(PeerError, RuntimeError):
    """A transfer that will not complete; the message says which prefill rank and why."""


class PlanError(ConnectorError, AssertionError):
    """A plan that breaks an invariant (a bug, not bad input)."""


class ServerError(PeerError, RuntimeError):
    """A `vllm serve` process that would not start, died, or answered with an error; the message carries its
    log's tail."""


class RequestFailed(PeerError, RuntimeError):
    """A server answered an HTTP request with an error (or an error event in its stream)."""

    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {body[:1000]}")
        self.status, self.body = status, body
