"""The bench's baseline: a descriptor list as one plain, blocking NIXL WRITE on the calling thread, with nothing of
the connector around it (no engine, no backpressure, no throttle, no stats). Bench-only, so it lives here and not
in the production transport; it borrows the transport's agent and peers rather than making its own."""

from __future__ import annotations

import time
from typing import Any

from connector.core.errors import TransportError
from connector.transport.nixl import Transport
from connector.transport.nixl.glue import descs_array, pair_check


def raw_write(transport: Transport, peer: str, local: Any, remote: Any, mem_type: str = "DRAM",
              timeout: float = 30.0) -> float:
    """WRITE local[i] -> remote[i] (pairs or Nx2/Nx3 arrays) to `peer`, a peer `transport` (an open
    connector.transport.nixl.Transport) has added: build the lists, initialize_xfer, transfer, poll to DONE (yielding,
    then 20 us sleeps), release. Call it from a worker thread, never an event loop. Returns the seconds it took;
    TransportError on failure or timeout."""
    ld, rd = descs_array(local), descs_array(remote)
    pair_check(ld, rd)
    if peer not in transport.peers:
        raise TransportError(f"peer {peer!r} is unknown to transport {transport.name!r}: add_peer it first")
    if not ld.shape[0]:
        return 0.0
    agent, handle = transport.agent, None
    t0 = time.perf_counter()
    try:
        handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(ld, mem_type), agent.get_xfer_descs(rd, mem_type),
                                       peer)
        state, spins = agent.transfer(handle), 0
        while state == "PROC":
            if time.perf_counter() - t0 > timeout:
                raise TransportError(f"raw WRITE to {peer!r} timed out after {timeout:g} s")
            time.sleep(0 if spins < 1000 else 2e-5)
            spins += 1
            state = agent.check_xfer_state(handle)
    except TransportError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the bindings raise, the bench reports it
        raise TransportError(f"raw WRITE of {ld.shape[0]} descriptor(s) to {peer!r} failed: {exc!r}") from exc
    finally:
        if handle is not None:
            handle.release()
    if state != "DONE":
        raise TransportError(f"raw WRITE to {peer!r} ended in state {state}")
    return time.perf_counter() - t0
