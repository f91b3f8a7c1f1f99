"""NIXL transport: the only package that imports nixl (lazily, on the first agent). No vllm here.

  agent           Transport: one NIXL agent (UCX backend) for asyncio: memory registration, peers, and its parts below
  glue            thin synchronous glue over NIXL 1.5.1's Python API: agents, descriptor arrays, memory regions
  poller          the thread that drives posted transfers to completion, and the live xfer handles
  settings        TransportConfig, the counters, and the byte gate (plain data and asyncio; no NIXL)
  sweep           the unload sweep: closes the sockets NIXL 1.5.1 keeps for unloaded peers (issue 33)
  writer          the write path: WRITEs under a byte budget and a post-rate cap, posted off the loop, reconnects

Open a `Transport` with `async with` or `open()` / `aclose()`."""

from connector.transport.nixl.agent import Transport
from connector.transport.nixl.settings import TransportConfig, TransportStats, WriteTiming
from connector.transport.nixl.glue import descs_array, make_agent

__all__ = ["Transport", "TransportConfig", "TransportStats", "WriteTiming", "descs_array", "make_agent"]
