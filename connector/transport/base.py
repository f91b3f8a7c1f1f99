"""What the engines use of a transport, as a Protocol: connector.engine types its transports by it, and
connector.transport.nixl.Transport is its one implementation (tests/test_transport_local.py keeps the two
signatures in step). Memory registration, opening and closing belong to whoever builds the transport (the vLLM
worker, a simulated rank), not to the engines."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from connector.transport.nixl.settings import WriteTiming

Descs = Sequence[tuple[int, int]] | np.ndarray
"""(address, bytes) pairs, or an Nx2 / Nx3 (with device id) integer array."""


class KVTransport(Protocol):
    """One rank's agent for one-sided WRITEs into its peers' registered memory."""

    @property
    def name(self) -> str:
        """Agent name, unique among all peers (the Hello carries it)."""

    @property
    def metadata(self) -> bytes:
        """What a peer loads to reach this agent (sent over the side channel, never unpickled)."""

    def add_peer(self, metadata: bytes, expected_name: str | None = None) -> str:
        """Load a peer's metadata (it must name `expected_name`); returns its agent name. Blocking: call it off the
        event loop."""

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (unknown ones are ignored). Blocking: call it off the event loop."""

    async def write(self, peer: str, local: Descs, remote: Descs, *, mem_type: str = "DRAM", local_device: int = 0,
                    remote_device: int = 0, timeout: float = 30.0) -> WriteTiming:
        """WRITE local[i] -> remote[i] on `peer`; returns once complete (raises TransportError, or WriteAbandoned
        while the transport still runs it: its memory stays in use until it ends)."""
